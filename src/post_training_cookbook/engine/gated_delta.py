"""A decode step for Gated DeltaNet layers: one token per row over the engine's state buffers.

A hybrid model's decode step runs the model's own forward (``decoder.py``), but each of its
Gated DeltaNet layers goes through ``decode_token`` for a single-token step over the engine's
``RecurrentStates`` instead of its module's generic path. The arithmetic is the model's own
(``torch_recurrent_gated_delta_rule``, ``causal_conv1d_update``, ``Qwen3_5RMSNormGated``),
without what costs a CPU step most (docs/performance.md):

- the four input projections are one matmul (the module's ``in_proj_*`` weights become views
  into the fused weight, as in ``fast_decode.py``, so weight updates reach it);
- the causal convolution of one new column is a multiply-add over the ``kernel`` columns of
  the state, not a grouped ``conv1d`` call (slow on CPU for one column);
- the delta rule updates the state in place, with matmuls for its reads;
- no activation module is built per call (the gated norm's ``ACT2FN`` lookup builds one).

Prefill (many tokens per row), and any call without the engine's cache, keep the module's
own forward. Only the engine's private copy of a model is changed (``install``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from post_training_cookbook.engine.fast_decode import fuse_linears
from post_training_cookbook.engine.recurrent import StateLayer

_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def install(model: Any) -> int:
    """Route the single-token steps of ``model``'s Gated DeltaNet layers through
    ``decode_token``; returns how many layers it routed."""
    count = 0
    for module in model.modules():
        if not type(module).__name__.endswith("GatedDeltaNet"):
            continue
        weight, _ = fuse_linears(module, _PROJECTIONS)
        module.forward = functools.partial(_forward, module, module.forward, weight)
        count += 1
    return count


def _forward(
    module: Any,
    original: Any,
    projections: torch.Tensor,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    if hidden_states.shape[1] == 1 and cache_params is not None:
        layer = cache_params.layers[module.layer_idx]
        if isinstance(layer, StateLayer):
            conv, recurrent = layer.view("conv"), layer.view("recurrent")
            return decode_token(module, projections, hidden_states, conv, recurrent)
    return original(
        hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
    )


def decode_token(
    module: Any,
    projections: torch.Tensor,
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """``[rows, 1, hidden]`` → the layer's output for one new token per row; updates
    ``conv_state`` ``[rows, conv_dim, kernel]`` and ``recurrent_state`` ``[rows, heads,
    key_dim, value_dim]`` (float32) in place."""
    rows, dtype = hidden_states.shape[0], hidden_states.dtype
    key_dim, value_dim, heads = module.key_dim, module.value_dim, module.num_v_heads
    head_k, head_v = module.head_k_dim, module.head_v_dim
    mixed, gate, b, a = F.linear(hidden_states[:, 0], projections).split(
        [module.conv_dim, value_dim, heads, heads], dim=-1
    )
    # The convolution reads the last ``kernel`` inputs, the new one last.
    window = torch.cat([conv_state[:, :, 1:], mixed[:, :, None].to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window)
    weight, bias = module.conv1d.weight[:, 0, :], module.conv1d.bias
    mixed = (window.to(weight.dtype) * weight).sum(-1)
    mixed = F.silu(mixed if bias is None else mixed + bias).to(dtype)
    query, key, value = mixed.split([key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(rows, -1, head_k).float()
    key = key.reshape(rows, -1, head_k).float()
    if heads // query.shape[1] > 1:
        query = query.repeat_interleave(heads // query.shape[1], dim=1)
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
    query = _l2norm(query) / head_k**0.5
    key = _l2norm(key)
    value = value.reshape(rows, heads, head_v).float()
    beta = b.sigmoid().float()
    decay = (-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)).exp()
    # S <- S * decay; S <- S + k (beta (v - k S)); out = q S   (per row and head)
    recurrent_state.mul_(decay[:, :, None, None])
    remembered = torch.matmul(key[:, :, None, :], recurrent_state)[:, :, 0]
    delta = (value - remembered) * beta[:, :, None]
    recurrent_state.add_(key[:, :, :, None] * delta[:, :, None, :])
    out = torch.matmul(query[:, :, None, :], recurrent_state)[:, :, 0].to(dtype)
    out = _gated_norm(module.norm, out, gate.reshape(rows, heads, head_v))
    return module.out_proj(out.reshape(rows, 1, value_dim))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gated_norm(norm: Any, states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``Qwen3_5RMSNormGated``: RMS-normalise in float32, scale, multiply by SiLU(gate)."""
    dtype = states.dtype
    states = states.float()
    states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    states = norm.weight * states.to(dtype)
    return (states * F.silu(gate.float())).to(dtype)
