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

Prefill (many tokens per row) stays on the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from post_training_cookbook.engine.kv import KVBatch, grouped_attention

# Mistral is left out: its sliding window would need a banded mask here.
_FAMILIES = frozenset({"llama", "qwen2", "qwen3"})


class FusedDecodeStep:
    """``step(...)`` → next-token logits; build with ``for_model``, which says when it can't."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        first = self.layers[0].self_attn
        self.head_dim: int = first.head_dim
        self.scaling: float = first.scaling
        self.qkv = [_fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers]
        self.gate_up = [_fuse(layer.mlp, ("gate_proj", "up_proj")) for layer in self.layers]

    @staticmethod
    def for_model(model: Any) -> FusedDecodeStep | None:
        """The fused step for ``model``, or None when its architecture is not one this covers."""
        if getattr(model.config, "model_type", None) not in _FAMILIES:
            return None
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
        return FusedDecodeStep(model) if len(inner.layers) else None

    def step(
        self, batch: KVBatch, rows: slice, lo: int, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits (float32) ``[rows, vocab]`` for ``input_ids`` [rows] at ``positions`` [rows],
        whose KV is written to the decode column; attention reads columns ``[lo, cols]``."""
        col = batch.cols
        cols = slice(col, col + 1)
        hi = col + 1
        if batch.dtype != torch.float32:
            # CPU bf16 matmul is slow on a strided window, and copying it costs more than
            # reading every column of the (contiguous) live rows; masked columns weigh 0.
            lo, hi = 0, batch.col_capacity
        bias = batch.attention_bias(rows, lo, hi, 1)
        hidden = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.model.rotary_emb(hidden, positions[:, None])  # [rows, 1, dim]
        for index, layer in enumerate(self.layers):
            residual = hidden
            query, key, value = self._qkv(index, layer, layer.input_layernorm(hidden))
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            batch.write(index, rows, cols, key[:, :, None], value[:, :, None])
            keys, values = batch.window(index, rows, lo, hi)
            grouped = query.view(query.shape[0], self.kv_heads, -1, self.head_dim)
            attended = grouped_attention(grouped, keys, values, bias, self.scaling)
            attention = layer.self_attn
            hidden = residual + attention.o_proj(attended.reshape(hidden.shape[0], -1))
            residual = hidden
            hidden = residual + self._mlp(index, layer.mlp, layer.post_attention_layernorm(hidden))
        hidden = self.model.model.norm(hidden)
        return self.model.lm_head(hidden).float()

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


def _linear(module: Any, name: str) -> torch.nn.Linear:
    linear = getattr(module, name)
    if type(linear) is not torch.nn.Linear:  # a quantised or adapter layer: not ours to fuse
        raise TypeError(f"{name} is a {type(linear).__name__}")
    return linear


def _fuse(module: Any, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
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
