"""A decode step for Llama-family models (Llama, Qwen2, Qwen3) without Hugging Face's forward.

Decoding is one token per row, so on CPU a step costs little compute and much per-op
overhead. Hugging Face's forward builds masks, cache objects and keyword plumbing every
layer; this step runs the same arithmetic straight over the engine's KV buffers:

- q, k and v come from one matmul, gate and up from another. The model's ``q_proj`` etc.
  weights become views into the fused tensors, so a weights update that copies into the
  model's parameters updates the fused weights too, and no weight is stored twice.
- Norms, the rotary embedding and the activation are the model's own modules, so the
  numbers are those of the model's forward up to matmul rounding.
- Attention groups query heads over the KV window instead of repeating KV heads.
- On CPU, when the native kernels could be built (``native/``), the whole step is one call
  into ``native/decode_step.cpp``: the same arithmetic (matmuls by torch, the rest as plain
  loops that round where Hugging Face's modules do), without Python's per-op cost, and
  attention reads each key once for all its query heads instead of one tiny matmul per row
  and head. The matmuls' weights are kept in oneDNN's packed layout as well (a second copy,
  up to ``PACK_MAX_BYTES``; ``weights_changed`` re-packs after an update). Models whose
  norms or activation are not the standard RMSNorm and SiLU keep the modules' own code and
  use the kernels' attention only.

Prefill (many tokens per row) stays on the model's own forward, and so does every step of a
hybrid model (Qwen3.5/3.6: Gated DeltaNet layers beside full attention, ``recurrent.py``):
this step is for dense models only, and ``for_model`` declines any other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from post_training_cookbook.engine.kv import KVBatch, grouped_attention
from post_training_cookbook.engine.native import NativeKernels, native_kernels
from post_training_cookbook.engine.recurrent import FULL_ATTENTION, layer_types

# Mistral is left out: its sliding window would need a banded mask here.
_FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
# Norms whose forward is the float32-statistics RMSNorm that decode_step.cpp reproduces.
_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# Packed copies of the matmul weights cost their size again (for faster matmuls, see
# docs/performance.md); past this, matmuls use the originals.
PACK_MAX_BYTES = 4 << 30


class FusedDecodeStep:
    """``step(...)`` → next-token logits; build with ``for_model``, which says when it can't."""

    def __init__(self, model: Any, kernels: NativeKernels | None = None) -> None:
        config = model.config
        self.kernels = kernels
        self.model = model
        self.layers = list(model.model.layers)
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        first = self.layers[0].self_attn
        self.head_dim: int = first.head_dim
        self.scaling: float = first.scaling
        self.qkv = [
            fuse_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers
        ]
        self.gate_up = [fuse_linears(layer.mlp, ("gate_proj", "up_proj")) for layer in self.layers]
        self.eps = float(getattr(config, "rms_norm_eps", 0.0))
        self.pack = kernels is not None and _can_pack(model)
        # decode_step.cpp's per-layer weights (see its Slot enum), or None if it can't run this
        self.native_weights = self._native_weights() if kernels is not None else None
        self._repack = False

    def weights_changed(self) -> None:
        """Call after the model's weights were updated in place: packed copies are rebuilt."""
        if self.native_weights is not None and self.pack:
            self.native_weights = self._native_weights()

    def release(self) -> None:
        """Drop the packed copies (a second copy of every matmul weight) while the engine is
        idle: a lockstep trainer's step peaks then, and the weight update that follows it
        would re-pack them anyway. The next step packs them again."""
        if self.native_weights is not None and self.pack:
            self.native_weights, self._repack = None, True

    @staticmethod
    def for_model(model: Any, native: bool = True) -> FusedDecodeStep | None:
        """The fused step for ``model``, or None when its architecture is not one this covers;
        ``native``: use the native kernels on CPU when they can be built."""
        if getattr(model.config, "model_type", None) not in _FAMILIES:
            return None
        if set(layer_types(model)) != {FULL_ATTENTION}:
            return None  # dense only: a hybrid's linear-attention layers run the model's forward
        inner: Any = getattr(model, "model", None)
        parts = ("layers", "embed_tokens", "rotary_emb", "norm")
        if not hasattr(model, "lm_head") or not all(hasattr(inner, part) for part in parts):
            return None
        try:
            for layer in inner.layers:
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    _linear(layer.self_attn, name)
                for name in ("gate_proj", "up_proj", "down_proj"):
                    _linear(layer.mlp, name)
        except (AttributeError, TypeError):
            return None
        if not len(inner.layers):
            return None
        on_cpu = next(model.parameters()).device.type == "cpu"
        return FusedDecodeStep(model, native_kernels() if native and on_cpu else None)

    def step(
        self, batch: KVBatch, rows: slice, lo: int, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits (float32) ``[rows, vocab]`` for ``input_ids`` [rows] at ``positions`` [rows],
        whose KV is written to the decode column; attention reads columns ``[lo, cols]``."""
        col = batch.cols
        cols = slice(col, col + 1)
        hi = col + 1
        # The kernels read row i of the buffers for input row i: rows must start at 0.
        native = self.kernels if rows.start in (0, None) else None
        if self._repack:
            self.native_weights, self._repack = self._native_weights(), False
        if native is not None and self.native_weights is not None:
            return self._native_step(batch, lo, input_ids, positions, native, self.native_weights)
        if native is None and batch.dtype != torch.float32:
            # CPU bf16 matmul is slow on a strided window, and copying it costs more than
            # reading every column of the (contiguous) live rows; masked columns weigh 0.
            lo, hi = 0, batch.col_capacity
        bias = batch.attention_bias(rows, lo, hi, 1) if native is None else None
        hidden = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.model.rotary_emb(hidden, positions[:, None])  # [rows, 1, dim]
        for index, layer in enumerate(self.layers):
            residual = hidden
            query, key, value = self._qkv(index, layer, layer.input_layernorm(hidden))
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            batch.write(index, rows, cols, key[:, :, None], value[:, :, None])
            grouped = query.view(query.shape[0], self.kv_heads, -1, self.head_dim)
            if native is not None:
                keys, values = batch.buffers(index)
                attended = native.decode_attention(
                    grouped, keys, values, batch.valid, lo, hi, self.scaling
                )
            else:
                keys, values = batch.window(index, rows, lo, hi)
                assert bias is not None
                attended = grouped_attention(grouped, keys, values, bias, self.scaling)
            attention = layer.self_attn
            hidden = residual + attention.o_proj(attended.reshape(hidden.shape[0], -1))
            residual = hidden
            hidden = residual + self._mlp(index, layer.mlp, layer.post_attention_layernorm(hidden))
        hidden = self.model.model.norm(hidden)
        return self.model.lm_head(hidden).float()

    def _native_step(
        self,
        batch: KVBatch,
        lo: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kernels: NativeKernels,
        weights: list[torch.Tensor],
    ) -> torch.Tensor:
        inner = self.model.model
        embed = inner.embed_tokens.weight
        cos, sin = inner.rotary_emb(embed, positions[:, None])  # [rows, 1, dim] in the model dtype
        buffers = [batch.buffers(index) for index in range(len(self.layers))]
        return kernels.decode_step(
            input_ids, cos[:, 0].contiguous(), sin[:, 0].contiguous(), embed, weights[:-1],
            inner.norm.weight, weights[-1], [keys for keys, _ in buffers],
            [values for _, values in buffers], batch.valid, batch.cols, lo, self.heads,
            self.eps, self.scaling,
        )  # fmt: skip

    def _native_weights(self) -> list[torch.Tensor] | None:
        """Per layer: input norm, qkv weight and bias, query and key norms, o weight and bias,
        post norm, gate-up weight and bias, down weight and bias (empty where absent); then
        the LM head's weight. Matmul weights packed when ``self.pack``."""
        model, config = self.model, self.model.config
        norms = [model.model.norm]
        for layer in self.layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            if hasattr(layer.self_attn, "q_norm"):
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        standard = (
            all(type(n).__name__ in _RMS_NORMS and n.variance_epsilon == self.eps for n in norms)
            and getattr(config, "hidden_act", None) in ("silu", "swish")
            and getattr(model.lm_head, "bias", None) is None
            and self.head_dim % 2 == 0
            and self.head_dim <= 1024
        )
        if not standard:
            return None
        empty = model.lm_head.weight.new_empty(0)

        def present(tensor: torch.Tensor | None) -> torch.Tensor:
            return empty if tensor is None else tensor.detach()

        def matmul(weight: torch.Tensor) -> torch.Tensor:
            weight = weight.detach()
            return torch.ops.mkldnn._reorder_linear_weight(weight) if self.pack else weight

        weights: list[torch.Tensor] = []
        for index, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, layer.mlp
            query_norm = getattr(attention, "q_norm", None)
            key_norm = getattr(attention, "k_norm", None)
            weights += [
                layer.input_layernorm.weight.detach(),
                matmul(self.qkv[index][0]),
                present(self.qkv[index][1]),
                present(query_norm.weight if query_norm is not None else None),
                present(key_norm.weight if key_norm is not None else None),
                matmul(attention.o_proj.weight),
                present(attention.o_proj.bias),
                layer.post_attention_layernorm.weight.detach(),
                matmul(self.gate_up[index][0]),
                present(self.gate_up[index][1]),
                matmul(mlp.down_proj.weight),
                present(mlp.down_proj.bias),
            ]
        if any(w.numel() and not w.is_mkldnn and not w.is_contiguous() for w in weights):
            return None
        return [*weights, matmul(model.lm_head.weight)]

    def _qkv(
        self, index: int, layer: Any, normed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query ``[rows, heads, dim]``, key and value ``[rows, kv_heads, dim]``."""
        weight, bias = self.qkv[index]
        rows, dim = normed.shape[0], self.head_dim
        q_size, kv_size = self.heads * dim, self.kv_heads * dim
        query, key, value = F.linear(normed, weight, bias).split([q_size, kv_size, kv_size], -1)
        query = query.reshape(rows, self.heads, dim)
        key = key.reshape(rows, self.kv_heads, dim)
        attention = layer.self_attn
        if hasattr(attention, "q_norm"):  # Qwen3 normalises each head
            query, key = attention.q_norm(query), attention.k_norm(key)
        return query, key, value.reshape(rows, self.kv_heads, dim)

    def _mlp(self, index: int, mlp: Any, normed: torch.Tensor) -> torch.Tensor:
        weight, bias = self.gate_up[index]
        gate, up = F.linear(normed, weight, bias).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)


def _can_pack(model: Any) -> bool:
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    supported = dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    return torch.backends.mkldnn.is_available() and supported and size <= PACK_MAX_BYTES


def _linear(module: Any, name: str) -> torch.nn.Linear:
    linear = getattr(module, name)
    if type(linear) is not torch.nn.Linear:  # a quantised or adapter layer: not ours to fuse
        raise TypeError(f"{name} is a {type(linear).__name__}")
    return linear


def fuse_linears(module: Any, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the named linears' weights (and biases) and make each linear's parameters
    views into the result, so later in-place weight copies reach the fused tensors."""
    linears = [_linear(module, name) for name in names]
    weight = torch.cat([linear.weight.detach() for linear in linears])
    offsets = [0]
    for linear in linears:
        offsets.append(offsets[-1] + linear.out_features)
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat(
            [
                linear.bias.detach()
                if linear.bias is not None
                else weight.new_zeros(linear.out_features)
                for linear in linears
            ]
        )
    for i, linear in enumerate(linears):
        part = slice(offsets[i], offsets[i + 1])
        linear.weight = torch.nn.Parameter(weight[part], requires_grad=False)
        if linear.bias is not None and bias is not None:
            linear.bias = torch.nn.Parameter(bias[part], requires_grad=False)
    return weight, bias


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for ``[rows, heads, dim]`` states and ``[rows, 1, dim]``
    cos/sin, op for op (so the rounding is the same)."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return (states * cos) + (rotated * sin)
