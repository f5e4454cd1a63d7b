"""Chosen-token log-probabilities through a frozen fp32 LM head, with their gradient taken in
forward: the trainer's path for LoRA (and any run whose head is not trained).

A trained token's log-probability log p(t | h) depends on its own hidden state h alone, and
through a linear head W its gradient is W[t] − softmax(W h)ᵀ W: one [hidden] row per
position. So a chunk of positions needs its logits only once: forward computes the
log-probabilities, the entropy and that gradient together, keeps the [positions, hidden]
gradient, and backward scales it by the loss's gradient. The generic path
(``logprobs._chunked_chosen_and_entropy``) keeps nothing vocabulary-sized either, but
recomputes each chunk's logits and log-softmax in backward (under
``torch.utils.checkpoint``) and differentiates through them: one more head matmul and
several more vocabulary-sized passes per chunk. A head that is trained (full weight, tied
embeddings) needs its weight's gradient, which depends on the loss, and keeps that path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel


def frozen_fp32_head(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The model's LM head when this path applies to it: a plain fp32 ``nn.Linear`` whose
    weight and bias take no gradient; else None."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight.dtype != torch.float32:
        return None
    if any(p.requires_grad for p in head.parameters()):
        return None
    return head


def chosen_and_entropy_frozen_head(
    head: torch.nn.Linear, rows: Tensor, targets: Tensor, chunk_tokens: int | None
) -> tuple[Tensor, Tensor]:
    """[positions] fp32 log-probabilities of ``targets`` given hidden-state ``rows`` through
    ``head``, and their summed entropy (no gradient), ``chunk_tokens`` positions' logits at a
    time (None: all at once). Equal to the generic path's values and gradients."""
    chosen, entropy = _FrozenHeadLogprobs.apply(rows, head.weight, head.bias, targets, chunk_tokens)
    return chosen, entropy


class _FrozenHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        rows: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_tokens: int | None,
    ) -> tuple[Tensor, Tensor]:
        count = rows.shape[0]
        step = max(1, count if chunk_tokens is None else chunk_tokens)  # 0 rows: no chunk
        chosen = torch.empty(count, dtype=torch.float32, device=rows.device)
        grad_rows = torch.empty((count, weight.shape[1]), dtype=torch.float32, device=rows.device)
        entropy = torch.zeros((), dtype=torch.float32, device=rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            for start in range(0, count, step):
                part = slice(start, start + step)
                picked = targets[part]
                logprobs = torch.nn.functional.linear(rows[part].float(), weight, bias)
                logprobs -= torch.logsumexp(logprobs, dim=-1, keepdim=True)
                chosen[part] = logprobs.gather(-1, picked[:, None]).squeeze(-1)
                probs = logprobs.exp()
                entropy -= (probs * logprobs).sum()
                del logprobs
                grad_rows[part] = weight.index_select(0, picked) - probs @ weight
        ctx.rows_dtype = rows.dtype
        ctx.save_for_backward(grad_rows)
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_chosen: Tensor, grad_entropy: Tensor | None
    ) -> tuple[Tensor, None, None, None, None]:
        (grad_rows,) = ctx.saved_tensors
        return (grad_chosen[:, None] * grad_rows).to(ctx.rows_dtype), None, None, None, None
