"""The trainer's attention on CPU: matmul and softmax for short sequences, SDPA beyond.

CPU SDPA (the flash kernel) computes its backward in small blocks, which costs more than
plain matmuls while the key length is short; the costs cross near 256 keys (the numbers are
in docs/performance.md). The math path keeps a [rows, heads, queries, keys] score tensor
for backward, which is another reason to leave long sequences to SDPA.

Past that, SDPA reads grouped KV heads in place (``enable_gqa``), with a mask too:
transformers repeats them to every query head whenever there is a mask, and backward keeps
the copies.

The trainer switches a model to this when it has the default SDPA attention (``use_for``;
off the CPU it is SDPA as before), which also lets it take packed micro-batches
(``packed_layout.py``); the name is not saved with checkpoints (transformers keeps it out
of ``config.json``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from post_training_cookbook.trainer.packed_layout import PackedLayout

TRAINER_ATTENTION = "post_training_cookbook_trainer"
MATH_MAX_KEYS = 256  # where the measured costs cross (docs/performance.md)


def trainer_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention signature: ``query`` [batch, heads, queries, dim], ``key``/``value``
    [batch, kv_heads, keys, dim], ``attention_mask`` from ``sdpa_mask`` (bool, True where a
    query may attend; None when plain causal). Returns [batch, queries, heads, dim].
    With ``packed_layout`` (a packed micro-batch, ``packed_layout.py``) it attends one
    segment of the stream at a time, each as below."""
    layout: PackedLayout | None = kwargs.pop("packed_layout", None)
    if layout is not None:
        return layout.attend(
            module, query, key, value, trainer_attention, dropout=dropout, scaling=scaling,
            **kwargs,
        )  # fmt: skip
    unusual = any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sliding_window"))
    long = key.shape[2] > MATH_MAX_KEYS
    if query.device.type != "cpu" or unusual or (dropout and module.training):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if long:
        causal = kwargs.get("is_causal")
        return _cpu_sdpa(module, query, key, value, attention_mask, scaling, causal)
    rows, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    # Query head h reads KV head h // group: grouping the query heads replaces repeat_kv's copy.
    grouped = query.reshape(rows, kv_heads, group * queries, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale
    scores = scores.view(rows, kv_heads, group, queries, keys)
    allowed = _allowed(attention_mask, module, queries, keys, query.device)
    if allowed is not None:
        # finfo.min, not -inf: a padding query that may attend nowhere gets finite weights.
        blocked = torch.finfo(torch.float32).min
        scores = scores.masked_fill(~allowed[:, :, None], blocked)
    weights = scores.softmax(-1).to(value.dtype).view(rows, kv_heads, group * queries, keys)
    out = torch.matmul(weights, value).view(rows, heads, queries, dim)
    return out.transpose(1, 2).contiguous(), None


def _cpu_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    is_causal: bool | None = None,
) -> tuple[Tensor, None]:
    """SDPA with grouped KV heads read in place (``enable_gqa``), mask or not: transformers
    repeats them whenever there is a mask (CUDA's fused kernels need that; CPU's does not),
    and backward kept the repeated copies (a shared-prefix stream's continuations gather
    their whole path's keys and values, so those were over a third of what it kept).
    ``is_causal`` (None: the module's) as transformers' SDPA attention takes it."""
    queries, keys = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain_causal = attention_mask is None and causal and queries == keys > 1
    mask = attention_mask
    if mask is None and causal and not plain_causal:  # fewer queries than keys: bottom right
        mask = _allowed(None, module, queries, keys, query.device)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, is_causal=plain_causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _allowed(
    mask: torch.Tensor | None,
    module: torch.nn.Module,
    queries: int,
    keys: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean [batch or 1, 1, queries, keys]: where a query may attend (None: everywhere)."""
    if mask is not None:
        if mask.dtype != torch.bool:  # an additive float mask
            return mask > torch.finfo(mask.dtype).min / 2
        return mask
    if queries == 1 or not getattr(module, "is_causal", True):
        return None
    # Causal over the last `queries` of `keys` positions.
    query_positions = torch.arange(keys - queries, keys, device=device)[:, None]
    return (torch.arange(keys, device=device)[None, :] <= query_positions)[None, None]


def use_for(model: Any) -> bool:
    """Switch ``model`` (a transformers model) to ``trainer_attention`` when it uses SDPA
    (on CUDA that is SDPA itself, plus packed layouts); any other choice (eager, flash) is
    left as it is. True when the model now uses ``trainer_attention``."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(TRAINER_ATTENTION)
    return getattr(config, "_attn_implementation", None) == TRAINER_ATTENTION


AttentionInterface.register(TRAINER_ATTENTION, trainer_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(TRAINER_ATTENTION, sdpa_mask)
