"""Draw one token per row from a batch of logits, each row with its own settings.

Every row is sampled by inverse CDF from a uniform number the caller supplies (one per
token, drawn from the row's own generator), so a row's token depends only on its logits
and its own random stream, never on which other rows share the batch. This is also an
order of magnitude cheaper than ``torch.multinomial`` on CPU.

A row takes one of three paths, chosen by its own settings only (so it never changes
with the company it keeps):
- greedy (temperature 0): argmax; log p from the untempered softmax;
- plain (no top-k / top-p): softmax(logits / T) in vocabulary order;
- filtered: the top ``max k`` logits in descending order, cut by each row's k, then by its
  top-p mass, renormalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from post_training_cookbook.engine.types import SamplingParams


@dataclass
class SampledTokens:
    """One token per row, with log p under the sampled distribution and under plain softmax."""

    tokens: torch.Tensor  # [rows] int64
    logprobs: list[float]
    raw_logprobs: list[float]


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> SampledTokens:
    """Sample ``logits`` [rows, vocab] (float32), row i with ``params[i]`` and ``uniforms[i]``."""
    rows, vocab = logits.shape
    greedy, plain, filtered = _split_rows(params, vocab)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    u = torch.tensor(uniforms, dtype=torch.float32, device=logits.device)
    raw_lse = logits.logsumexp(-1)
    if plain:
        index = _index(plain, rows, logits.device)
        temperatures = [params[i].temperature for i in plain]
        if all(t == 1.0 for t in temperatures):  # the RL default: reuse the plain softmax
            scaled, lse = logits[index], raw_lse[index]
        else:
            scaled = logits[index] / _column(temperatures, logits)
            lse = scaled.logsumexp(-1)
        tokens[index], logprobs[index] = _sample_plain(scaled, lse, u[index])
    if filtered:
        index = _index(filtered, rows, logits.device)
        tokens[index], logprobs[index] = _sample_filtered(
            logits[index], [params[i] for i in filtered], u[index]
        )
    if greedy:
        index = _index(greedy, rows, logits.device)
        tokens[index] = logits[index].argmax(-1)
    raw = logits.gather(1, tokens[:, None]).squeeze(1) - raw_lse
    if greedy:
        logprobs[index] = raw[index]
    return SampledTokens(tokens, logprobs.tolist(), raw.tolist())


def _split_rows(params: Sequence[SamplingParams], vocab: int) -> tuple[list[int], ...]:
    greedy, plain, filtered = [], [], []
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            greedy.append(i)
        elif 0 < p.top_k < vocab or p.top_p < 1.0:
            filtered.append(i)
        else:
            plain.append(i)
    return greedy, plain, filtered


def _index(rows: list[int], total: int, device: torch.device) -> torch.Tensor | slice:
    # The common case (every row on one path) needs no gather of a [rows, vocab] tensor.
    if len(rows) == total:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j with cdf[j-1] <= u * total < cdf[j]; ``right=True`` never picks a zero-mass slot."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def _sample_plain(
    scaled: torch.Tensor, lse: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = _inverse_cdf((scaled - lse[:, None]).exp(), u)
    return tokens, scaled.gather(1, tokens[:, None]).squeeze(1) - lse


def _sample_filtered(
    logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    temperature = _column([p.temperature for p in params], logits)
    # topk(max k) sorts only as much as the widest row needs; top-p without top-k needs all.
    values, ids = (logits / temperature).topk(max(ks), dim=-1)
    rank = torch.arange(values.shape[-1], device=logits.device)
    values = values.masked_fill(rank[None, :] >= _column(ks, values), float("-inf"))
    probs = values.softmax(-1)
    # Keep a token when the mass strictly before it is below top_p: the smallest set that
    # reaches top_p, and always the most likely token.
    mass_before = probs.cumsum(-1) - probs
    values = values.masked_fill(
        mass_before >= _column([p.top_p for p in params], probs), -torch.inf
    )
    logp = values.log_softmax(-1)
    picks = _inverse_cdf(logp.exp(), u)
    return ids.gather(1, picks[:, None]).squeeze(1), logp.gather(1, picks[:, None]).squeeze(1)
