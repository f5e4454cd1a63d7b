"""A decode step for Gated DeltaNet layers: one token per row over the engine's state buffers.

A hybrid model's decode step runs the model's own forward (``decoder.py``), but each of its
Gated DeltaNet layers goes through ``decode_token`` for a single-token step over the engine's
``RecurrentStates`` instead of its module's generic path. The arithmetic is the model's own
(``torch_recurrent_gated_delta_rule``, ``causal_conv1d_update``, ``Qwen3_5RMSNormGated``),
without what costs a CPU step most (docs/performance.md):

- the four input projections are one matmul (the module's ``in_proj_*`` weights become views
  into the fused weight, as in ``fast_decode.py``, so weight updates reach it);
- the causal convolution of one new column is a multiply-add over the ``kernel`` columns of
  the state, not a grouped ``conv1d`` call (slow on CPU for one column), computed
  kernel-major: the engine stores the conv states and the conv weight so;
- the delta rule reads the state once before updating it in place, with no temporary of its
  size (the state is most of the memory a step touches);
- no activation module is built per call (the gated norm's ``ACT2FN`` lookup builds one).

On CPU, with the native kernels (``native/``), everything between the layer's two matmuls is
one call (``native_decode_token``): the same arithmetic and roundings without some forty small
ops, and one pass over each head's state. Prefill (many tokens per row), and any call without
the engine's cache, keep the module's own forward. Only the engine's private copy of a model
is changed (``install``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from post_training_cookbook.engine.fast_decode import fuse_linears
from post_training_cookbook.engine.native import NativeKernels
from post_training_cookbook.engine.recurrent import StateLayer

_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

DecodeToken = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(hidden_states, conv_state, recurrent_state) -> output`` of one layer (``decode_token``
or ``native_decode_token`` bound to the layer)."""


def install(model: Any, kernels: NativeKernels | None = None) -> int:
    """Route the single-token steps of ``model``'s Gated DeltaNet layers through
    ``decode_token``, or through the native kernels' step when given (a CPU model); returns
    how many layers it routed."""
    count = 0
    for module in model.modules():
        if not type(module).__name__.endswith("GatedDeltaNet"):
            continue
        weight, _ = fuse_linears(module, _PROJECTIONS)
        _kernel_major(module.conv1d)
        if kernels is None:
            step: DecodeToken = functools.partial(decode_token, module, weight)
        else:
            step = functools.partial(native_decode_token, kernels, module, weight)
        module.forward = functools.partial(_forward, module, module.forward, step)
        count += 1
    return count


def _kernel_major(conv: torch.nn.Conv1d) -> None:
    """Store the depthwise conv weight ``[conv_dim, 1, kernel]`` kernel-major; the parameter
    keeps its shape as a view, so weight updates copied into it reach ``_convolve``."""
    columns = conv.weight.detach()[:, 0, :].t().contiguous()
    conv.weight = torch.nn.Parameter(columns.t()[:, None, :], requires_grad=False)


def _forward(
    module: Any,
    original: Any,
    step: DecodeToken,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    if hidden_states.shape[1] == 1 and cache_params is not None:
        layer = cache_params.layers[module.layer_idx]
        if isinstance(layer, StateLayer):
            return step(hidden_states, layer.view("conv"), layer.view("recurrent"))
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
    mixed = _convolve(module.conv1d, conv_state, mixed).to(dtype)
    # Query and key heads side by side, normalised per head before they are repeated for
    # the value heads (the same numbers, on fewer elements): [rows, key_heads, 2, head_k].
    pairs = _l2norm(mixed[:, : 2 * key_dim].reshape(rows, 2, -1, head_k).float())
    pairs[:, 0].div_(head_k**0.5)
    pairs = pairs.transpose(1, 2)
    if heads // pairs.shape[1] > 1:
        pairs = pairs.repeat_interleave(heads // pairs.shape[1], dim=1)
    value = mixed[:, 2 * key_dim :].reshape(rows, heads, head_v).float()
    beta = b.sigmoid().float()
    decay = (-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)).exp()
    out = _delta_rule(pairs, value, decay, beta, recurrent_state).to(dtype)
    out = _gated_norm(module.norm, out, gate.reshape(rows, heads, head_v))
    return module.out_proj(out.reshape(rows, 1, value_dim))


def native_decode_token(
    kernels: NativeKernels,
    module: Any,
    projections: torch.Tensor,
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """``decode_token`` with everything between its two matmuls in one native call
    (``native/decode_step.cpp``'s ``gated_delta_step``: the same arithmetic and roundings,
    without some forty small ops and with one pass over the delta rule's state)."""
    rows = hidden_states.shape[0]
    conv = module.conv1d
    out = kernels.gated_delta_step(
        F.linear(hidden_states[:, 0], projections),
        conv_state.transpose(1, 2),  # kernel-major: the engine's buffers
        conv.weight[:, 0, :].t(),  # kernel-major after ``install``
        conv.bias if conv.bias is not None else conv.weight.new_empty(0),
        module.A_log.float(),
        module.dt_bias.float(),
        module.norm.weight,
        module.norm.variance_epsilon,
        recurrent_state,
        module.num_k_heads,
    )
    return module.out_proj(out.reshape(rows, 1, -1))


def _convolve(conv: Any, state: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution (then SiLU) of one new input column ``[rows,
    conv_dim]`` per row over the last ``kernel`` inputs, the new one last; shifts it into
    ``state`` ``[rows, conv_dim, kernel]``.

    It computes kernel-major, ``[rows, kernel, conv_dim]``: the engine's conv states and (after
    ``install``) the conv weight are stored so, which makes this a few whole-row
    multiply-adds; summed over a last axis of ``kernel`` columns it ran 2-4x slower
    (docs/performance.md).

    Products, sum and bias are float32, rounded to the model's dtype once, as Hugging Face's
    ``conv1d`` (and ``decode_step.cpp``) round them: in bfloat16, rounding each product and
    then the bias sum changed a third of the outputs by an ulp, which the recurrent state
    carried on (the native step then differed from this one by up to 0.39 of the logits'
    scale on random tiny hybrids, tests/test_native_parity.py; 0.003 after)."""
    columns = state.transpose(1, 2)
    window = torch.cat([columns[:, 1:], new[:, None].to(columns.dtype)], dim=1)
    columns.copy_(window)
    weight = conv.weight[:, 0, :].t()  # [kernel, conv_dim]
    out = (window.float() * weight.float()).sum(1)
    if conv.bias is not None:
        out = out + conv.bias.float()
    return F.silu(out.to(weight.dtype))


def _delta_rule(
    pairs: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of the gated delta rule per row and head: ``pairs`` ``[rows, heads, 2,
    key_dim]`` holds each head's query and key, ``state`` ``[rows, heads, key_dim,
    value_dim]`` is updated in place; returns the output ``[rows, heads, value_dim]``.

    The model's rule, ``S <- decay S; S <- S + k (beta (v - k S)); out = q S``, rewritten so
    that the state is read once before it is written (the state is most of what a step
    touches: 2 MiB a layer at 32 rows of the benchmark's model) and no temporary of its size
    is made: ``q S`` and ``k S`` of the old state come from one matmul, and with ``delta =
    beta (v - decay k S)``, ``q S_new = decay q S + (q . k) delta``. The same arithmetic up
    to float rounding.
    """
    read = torch.matmul(pairs, state)  # [rows, heads, 2, value_dim]
    query, key = pairs[:, :, 0], pairs[:, :, 1]
    decay = decay[:, :, None]
    delta = (value - read[:, :, 1] * decay) * beta[:, :, None]
    state.mul_(decay[..., None]).addcmul_(key[:, :, :, None], delta[:, :, None, :])
    return read[:, :, 0] * decay + (query * key).sum(-1, keepdim=True) * delta


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gated_norm(norm: Any, states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``Qwen3_5RMSNormGated``: RMS-normalise in float32, scale, multiply by SiLU(gate)."""
    dtype = states.dtype
    states = states.float()
    states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    states = norm.weight * states.to(dtype)
    return (states * F.silu(gate.float())).to(dtype)
