"""Gated DeltaNet (linear-attention) layers over a packed stream (``packed_layout.py``).

A linear-attention layer carries state along its sequence: a causal conv over the last
``kernel`` inputs, then the gated delta rule's recurrent state. Over a packed stream both
must restart at each sample's start, and with shared prefixes each sample's continuation
must start from the state its shared prefix ended with, not from where the stream's
previous sample ended. Transformers' forward runs the stream as one sequence, so the
trainer swaps in ``packed_forward`` (``use_for``), which reads the layout's pieces
(``RecurrentLayout``):

- the conv runs over the whole stream as one sequence (the plain path's call), and the few
  tokens whose window crosses a piece's start into another path (the first ``kernel - 1``
  of a sample, or of a continuation after its shared prefix) are recomputed from their
  path's own window;
- the delta rule runs piece by piece, a tree depth at a time: pieces of similar length as
  the rows of one call of the model's own chunked rule (the fused kernel where transformers
  found one), each starting from its parent's final state (zero at a path's start).

Everything is ordinary autograd: a shared prefix's final state feeds every continuation,
so its gradient is the sum over them, as the padded rows' would be. Padding slots in a
row carry β = 0 and decay 0, where the rule leaves the state as it is (its own chunk
padding relies on the same), so a short row's final state is exact.

Which modules: ``Qwen3_5GatedDeltaNet`` and ``Qwen3_5MoeGatedDeltaNet`` (Qwen3.5, Qwen3.6
and the hosted guide's hybrids). Other recurrent layers (Qwen3-Next's Gated DeltaNet, Mamba,
LFM2's short convs, ...) have no packed forward here; ``packing.choose_packing`` keeps
their models on padded rows and says so.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.activations import ACT2FN

from post_training_cookbook.trainer.packed_layout import PackedLayout, RecurrentLayout

SUPPORTED = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})
"""Class names of the linear-attention modules ``packed_forward`` reimplements."""

DeltaRule = Callable[..., tuple[Tensor, Tensor | None]]


def use_for(model: torch.nn.Module) -> int:
    """Give every supported linear-attention module of ``model`` ``packed_forward``
    (its own forward still runs whenever there is no packed layout). Returns how many
    modules have it now."""
    count = 0
    for module in model.modules():
        if _supported_class(type(module)) is None:
            continue
        if not has_packed_forward(module):
            # An instance attribute: deep copies (the reference model) rebind it to the copy.
            module.forward = types.MethodType(packed_forward, module)
        count += 1
    return count


def has_packed_forward(module: torch.nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is packed_forward


def installed(model: torch.nn.Module) -> bool:
    """Some module of ``model`` has ``packed_forward`` (``use_for`` found what it knows)."""
    return any(has_packed_forward(module) for module in model.modules())


def packed_forward(
    self: Any,
    hidden_states: Tensor,
    cache_params: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` (transformers 5.19) where ``packed_layout`` is
    given (``hidden_states`` [1, stream, hidden]): the same projections, gating and norm,
    with the conv and the delta rule run per piece of the layout's tree."""
    layout: PackedLayout | None = kwargs.pop("packed_layout", None)
    if layout is None:
        return cast(
            Tensor,
            type(self).forward(
                self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                **kwargs,
            ),
        )  # fmt: skip
    if cache_params is not None:
        raise ValueError("a packed layout is for training forwards, without a cache")
    tree = layout.recurrent
    length = hidden_states.shape[1]
    mixed_qkv = packed_causal_conv(
        tree, self.in_proj_qkv(hidden_states)[0], self.conv1d, self.activation
    )[None]
    z = self.in_proj_z(hidden_states).reshape(1, length, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], -1)
    query = query.reshape(1, length, -1, self.head_k_dim)
    key = key.reshape(1, length, -1, self.head_k_dim)
    value = value.reshape(1, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    # As transformers: in fp32, or A might be -inf in fp16.
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    if self.num_v_heads // self.num_k_heads > 1:
        query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
    core = packed_delta_rule(tree, delta_rule_of(self), query, key, value, g, beta)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return cast(Tensor, self.out_proj(core.reshape(1, length, -1)))


def packed_causal_conv(
    tree: RecurrentLayout, mixed: Tensor, conv: torch.nn.Conv1d, activation: str
) -> Tensor:
    """[stream, channels] → the depthwise causal ``conv`` and ``activation`` of each token
    over its own path's last ``kernel`` inputs (as transformers' ``causal_conv1d_fn``)."""
    weight = conv.weight.squeeze(1)  # [channels, kernel]
    channels, kernel = weight.shape
    inputs = mixed.to(weight.dtype)
    stream = mixed.shape[0]
    conv_out = F.conv1d(
        inputs.T[None], weight[:, None], conv.bias, padding=kernel - 1, groups=channels
    )
    out = conv_out[0, :, :stream].T
    fixes = tree.conv_windows(kernel)
    if fixes.positions.numel():
        # Index -1 (before a path's start) picks the appended zero row.
        with_zero = torch.cat([inputs, inputs.new_zeros(1, channels)])
        windows = with_zero[fixes.windows]  # [fixes, kernel, channels]
        fixed = torch.einsum("fkc,ck->fc", windows, weight)
        if conv.bias is not None:
            fixed = fixed + conv.bias
        out = out.index_copy(0, fixes.positions, fixed.to(out.dtype))
    return cast(Tensor, ACT2FN[activation](out)).to(mixed.dtype)


def packed_delta_rule(
    tree: RecurrentLayout,
    rule: DeltaRule,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
) -> Tensor:
    """The gated delta rule over the stream, one bucket of pieces at a time, each piece from
    its parent's final state. ``query``/``key`` [1, stream, heads, k_dim], ``value``
    [1, stream, heads, v_dim], ``g``/``beta`` [1, stream, heads]; returns
    [1, stream, heads, v_dim]."""
    final_states: dict[int, Tensor] = {}
    outputs = []
    for bucket in tree.buckets:

        def rows(x: Tensor, bucket: Any = bucket) -> Tensor:
            picked = x[0].index_select(0, bucket.index)
            return picked.view(bucket.rows, bucket.length, *x.shape[2:])

        valid = bucket.valid.view(bucket.rows, bucket.length, 1)
        initial = (
            None
            if bucket.parents is None
            else torch.stack([final_states[parent] for parent in bucket.parents])
        )
        out, final = rule(
            rows(query), rows(key), rows(value),
            g=rows(g) * valid, beta=rows(beta) * valid,  # padding leaves the state alone
            initial_state=initial, output_final_state=bucket.keeps_state,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        if final is not None:
            final_states.update(zip(bucket.pieces, final, strict=True))
        outputs.append(out.flatten(0, 1)[bucket.valid])
    return torch.cat(outputs)[tree.stream_order][None]


def delta_rule_of(module: torch.nn.Module) -> DeltaRule:
    """The chunked gated delta rule the module's own forward calls (transformers' reference
    or the fused kernel it found), from the module that defines the module's class."""
    defining = _supported_class(type(module))
    if defining is None:
        raise TypeError(f"{type(module).__name__} has no packed forward")
    return cast(DeltaRule, sys.modules[defining.__module__].torch_chunk_gated_delta_rule)


def _supported_class(cls: type) -> type | None:
    """The class in ``cls``'s MRO that ``packed_forward`` reimplements (FSDP2 wraps a module
    in a subclass of its own)."""
    return next((c for c in cls.__mro__ if c.__name__ in SUPPORTED), None)
