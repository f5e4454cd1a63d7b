"""Policy-gradient losses, one function per variant, looked up by name (``get_loss_fn``).

Every loss takes per-token ``[batch, time]`` tensors aligned with ``TrainingSample``
(position ``t`` scores ``tokens[t]``) and returns ``(loss, metrics)``:

- ``logprobs``: the trainer's log π_θ of each token (with grad);
- ``sampler_logprobs``: the behaviour policy's log π_old, recorded at sampling time;
- ``advantages`` and ``mask`` (1 on trained tokens): masked positions must hold finite values;
- ``reference_logprobs``: log π_ref of a frozen reference, required when ``kl_beta > 0``;
- ``trainer_old_logprobs``: the trainer's pre-update log-probabilities for TIS; by default
  ``logprobs.detach()``, right for every ``forward_backward`` before an ``optim_step``;
- ``totals``: counts over the *whole* batch. Each loss returns its micro-batch's share of the
  batch loss, so summing the shares of any split of a batch gives the same loss and gradient.

Metrics are means over this call's trained tokens; average them across micro-batches
weighted by ``mask.sum()``. Formulas and their sources are in ``docs/losses.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from post_training_cookbook.trainer.types import SFT_LOSS, TRAINER_LOSS_TYPES, LossConfig

Metrics = dict[str, float]


@dataclass(frozen=True)
class BatchTotals:
    """Normalisers taken over the whole batch, shared by all its micro-batches."""

    num_sequences: int
    """Sequences with at least one trained token."""
    num_tokens: float
    """Sum of the mask over the batch."""
    max_sequence_tokens: float
    """Largest per-sequence mask sum: Dr. GRPO's default horizon."""

    @classmethod
    def of(cls, mask: Tensor) -> BatchTotals:
        per_sequence = mask.sum(dim=-1)
        return cls(
            num_sequences=int((per_sequence > 0).sum().item()),
            num_tokens=float(per_sequence.sum().item()),
            max_sequence_tokens=float(per_sequence.max().item()) if mask.numel() else 0.0,
        )


class LossFn(Protocol):
    def __call__(
        self,
        logprobs: Tensor,
        sampler_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        config: LossConfig,
        *,
        reference_logprobs: Tensor | None = None,
        trainer_old_logprobs: Tensor | None = None,
        totals: BatchTotals | None = None,
    ) -> tuple[Tensor, Metrics]: ...


# ---------------------------------------------------------------- shared pieces


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    return float((values * mask).sum().item() / max(mask.sum().item(), 1e-8))


def _old_logprobs_and_tis(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    config: LossConfig,
    trainer_old_logprobs: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The log π_old that ratios are taken against, and the per-token TIS weight (or None).

    Without TIS, π_old is the sampler. With TIS the ratio is taken against the trainer's
    pre-update policy and the sampler/trainer mismatch is carried by the capped weight alone;
    taking the ratio against the sampler as well would correct the mismatch twice.
    """
    if config.tis_cap is None:
        return sampler_logprobs, None
    trainer_old = logprobs.detach() if trainer_old_logprobs is None else trainer_old_logprobs
    weight = torch.exp(trainer_old - sampler_logprobs).clamp(max=config.tis_cap)
    return trainer_old, weight


def _k3_kl(logprobs: Tensor, reference_logprobs: Tensor | None) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref): exp(d) − d − 1 with d = log π_ref − log π_θ."""
    if reference_logprobs is None:
        raise ValueError("kl_beta > 0 needs reference_logprobs")
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def _common_metrics(
    logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, kl: Tensor | None
) -> Metrics:
    metrics = {
        "loss/sampler_trainer_abs_diff": _masked_mean(
            (sampler_logprobs - logprobs.detach()).abs(), mask
        )
    }
    if kl is not None:
        metrics["loss/kl_ref"] = _masked_mean(kl.detach(), mask)
    return metrics


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, config: LossConfig) -> Tensor:
    """−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), elementwise."""
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _clip_fractions(ratio: Tensor, advantages: Tensor, mask: Tensor, config: LossConfig) -> Metrics:
    """Fractions of trained tokens where the clip is active, i.e. their gradient is zero."""
    ratio = ratio.detach()
    low = (ratio < 1.0 - config.clip_low) & (advantages < 0)
    high = (ratio > 1.0 + config.clip_high) & (advantages > 0)
    return {
        "loss/clip_low_fraction": _masked_mean(low.float(), mask),
        "loss/clip_high_fraction": _masked_mean(high.float(), mask),
    }


def _token_ratio_terms(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    reference_logprobs: Tensor | None,
    trainer_old_logprobs: Tensor | None,
) -> tuple[Tensor, Metrics]:
    """Per-token ℓ_t = −w_t·min(r_t·A_t, clip(r_t)·A_t) + β·k3_t, shared by GRPO, DAPO, Dr. GRPO."""
    old, tis = _old_logprobs_and_tis(logprobs, sampler_logprobs, config, trainer_old_logprobs)
    ratio = torch.exp(logprobs - old)
    terms = _clipped_surrogate(ratio, advantages, config)
    metrics = _clip_fractions(ratio, advantages, mask, config)
    if tis is not None:
        terms = terms * tis
        metrics["loss/tis_weight_mean"] = _masked_mean(tis, mask)
    kl = _k3_kl(logprobs, reference_logprobs) if config.kl_beta > 0 else None
    if kl is not None:
        terms = terms + config.kl_beta * kl
    metrics.update(_common_metrics(logprobs, sampler_logprobs, mask, kl))
    return terms, metrics


def _per_sequence_means(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1e-8)


# ---------------------------------------------------------------- the variants


def grpo_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    reference_logprobs: Tensor | None = None,
    trainer_old_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> tuple[Tensor, Metrics]:
    """GRPO: token ratio, PPO clip, mean over each sequence's tokens, then over sequences.

    r_t = exp(log π_θ − log π_old),
    ℓ_t = −w_t·min(r_t·A_t, clip(r_t, 1−ε_low, 1+ε_high)·A_t) + β·k3_t,
    L = (1/G) Σ_i (1/|o_i|) Σ_{t∈o_i} ℓ_t   (G sequences, |o_i| trained tokens of sequence i),
    w_t = 1 without TIS (see ``_old_logprobs_and_tis``).
    """
    totals = totals or BatchTotals.of(mask)
    terms, metrics = _token_ratio_terms(
        logprobs, sampler_logprobs, advantages, mask, config,
        reference_logprobs, trainer_old_logprobs,
    )  # fmt: skip
    loss = _per_sequence_means(terms, mask).sum() / max(totals.num_sequences, 1)
    return loss, metrics


def dapo_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    reference_logprobs: Tensor | None = None,
    trainer_old_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> tuple[Tensor, Metrics]:
    """DAPO: GRPO's per-token term (use clip-higher, e.g. ε_high = 0.28), averaged over all
    trained tokens of the batch, so long sequences weigh in proportion to their length.

    L = Σ_i Σ_{t∈o_i} ℓ_t / Σ_i |o_i|.
    """
    totals = totals or BatchTotals.of(mask)
    terms, metrics = _token_ratio_terms(
        logprobs, sampler_logprobs, advantages, mask, config,
        reference_logprobs, trainer_old_logprobs,
    )  # fmt: skip
    loss = (terms * mask).sum() / max(totals.num_tokens, 1e-8)
    return loss, metrics


def dr_grpo_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    reference_logprobs: Tensor | None = None,
    trainer_old_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> tuple[Tensor, Metrics]:
    """Dr. GRPO: GRPO's per-token term summed over each sequence and divided by a fixed
    horizon H instead of the sequence's own length (no length bias).

    L = (1/G) Σ_i Σ_{t∈o_i} ℓ_t / H,  H = ``dr_grpo_horizon`` or the batch's largest |o_i|.
    Dr. GRPO's other half, advantages without division by the group std, is the loop's job:
    this loss uses the advantages it is given.
    """
    totals = totals or BatchTotals.of(mask)
    terms, metrics = _token_ratio_terms(
        logprobs, sampler_logprobs, advantages, mask, config,
        reference_logprobs, trainer_old_logprobs,
    )  # fmt: skip
    horizon = config.dr_grpo_horizon or totals.max_sequence_tokens
    loss = (terms * mask).sum() / (max(totals.num_sequences, 1) * max(horizon, 1e-8))
    return loss, metrics


def gspo_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    reference_logprobs: Tensor | None = None,
    trainer_old_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO: one length-normalised ratio per sequence, clipped per sequence (ε ≈ 3e-4 / 4e-4).

    s_i = exp((1/|o_i|) Σ_{t∈o_i} (log π_θ − log π_old)),  A_i = mean of A_t over o_i,
    ℓ_i = −w_i·min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i) + β·(1/|o_i|) Σ_t k3_t,
    L = (1/G) Σ_i ℓ_i.  With TIS, w_i = min(exp(mean_t(log π_θold − log π_sampler)), cap),
    the sequence-level weight that matches a sequence-level ratio.
    """
    totals = totals or BatchTotals.of(mask)
    old, _ = _old_logprobs_and_tis(logprobs, sampler_logprobs, config, trainer_old_logprobs)
    ratio = torch.exp(_per_sequence_means(logprobs - old, mask))
    sequence_advantages = _per_sequence_means(advantages, mask)
    terms = _clipped_surrogate(ratio, sequence_advantages, config)
    # Sequence quantities broadcast over their tokens, so metrics stay token-weighted.
    metrics = _clip_fractions(ratio[:, None], sequence_advantages[:, None], mask, config)
    if config.tis_cap is not None:
        trainer_old = old  # with TIS, old is the trainer's pre-update policy
        tis = torch.exp(_per_sequence_means(trainer_old - sampler_logprobs, mask))
        tis = tis.clamp(max=config.tis_cap)
        terms = terms * tis
        metrics["loss/tis_weight_mean"] = _masked_mean(tis[:, None].expand_as(mask), mask)
    kl = _k3_kl(logprobs, reference_logprobs) if config.kl_beta > 0 else None
    if kl is not None:
        terms = terms + config.kl_beta * _per_sequence_means(kl, mask)
    metrics.update(_common_metrics(logprobs, sampler_logprobs, mask, kl))
    has_tokens = (mask.sum(dim=-1) > 0).to(terms.dtype)
    loss = (terms * has_tokens).sum() / max(totals.num_sequences, 1)
    return loss, metrics


def cispo_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    reference_logprobs: Tensor | None = None,
    trainer_old_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> tuple[Tensor, Metrics]:
    """CISPO: REINFORCE weighted by a capped, stop-gradient IS ratio; no token is ever dropped.

    r_t = exp(log π_θ − log π_old),  ℓ_t = −sg(min(r_t, 1+ε_high))·w_t·A_t·log π_θ + β·k3_t,
    L = Σ_i Σ_{t∈o_i} ℓ_t / Σ_i |o_i|  (token mean over the batch).
    ``clip_low`` is unused: CISPO has no lower bound. ``loss/clip_high_fraction`` counts tokens
    whose weight was capped (their gradient shrinks but stays non-zero).
    """
    totals = totals or BatchTotals.of(mask)
    old, tis = _old_logprobs_and_tis(logprobs, sampler_logprobs, config, trainer_old_logprobs)
    ratio = torch.exp(logprobs.detach() - old)
    weight = ratio.clamp(max=1.0 + config.clip_high)
    terms = -weight * advantages * logprobs
    metrics = {
        "loss/clip_low_fraction": 0.0,
        "loss/clip_high_fraction": _masked_mean((ratio > 1.0 + config.clip_high).float(), mask),
    }
    if tis is not None:
        terms = terms * tis
        metrics["loss/tis_weight_mean"] = _masked_mean(tis, mask)
    kl = _k3_kl(logprobs, reference_logprobs) if config.kl_beta > 0 else None
    if kl is not None:
        terms = terms + config.kl_beta * kl
    metrics.update(_common_metrics(logprobs, sampler_logprobs, mask, kl))
    loss = (terms * mask).sum() / max(totals.num_tokens, 1e-8)
    return loss, metrics


def sft_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    reference_logprobs: Tensor | None = None,
    trainer_old_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> tuple[Tensor, Metrics]:
    """Supervised fine-tuning: the negative log-likelihood of the trained tokens, averaged
    over every trained token of the batch (``totals``), whatever the micro-batches.

    L = −Σ_i Σ_{t∈o_i} m_t·log π_θ(x_t) / Σ_i Σ_t m_t.
    Dividing by the batch's token count, not by each sequence's, keeps the loss and its
    gradient the same however conversations are grouped into rows (micro-batches now,
    packed rows later). ``sampler_logprobs``, ``advantages`` and the clip settings are unused.
    """
    totals = totals or BatchTotals.of(mask)
    loss = -(logprobs * mask).sum() / max(totals.num_tokens, 1e-8)
    return loss, {"loss/nll": -_masked_mean(logprobs.detach(), mask)}


LOSS_FNS: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "dapo": dapo_loss,
    "dr_grpo": dr_grpo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    SFT_LOSS: sft_loss,
}
assert set(LOSS_FNS) == set(TRAINER_LOSS_TYPES)


def get_loss_fn(loss_type: str) -> LossFn:
    """The loss function for ``loss_type``: a dictionary lookup, which the trainer makes on
    every ``forward_backward`` (each call names its loss in its ``LossConfig``)."""
    try:
        return LOSS_FNS[loss_type]
    except KeyError:
        raise ValueError(
            f"loss_type must be one of {TRAINER_LOSS_TYPES}, got {loss_type!r}"
        ) from None


def token_entropy(logprobs_over_vocab: Tensor) -> Tensor:
    """Entropy −Σ_v p_v log p_v of each row of log-probabilities over the vocabulary."""
    return -(logprobs_over_vocab.exp() * logprobs_over_vocab).sum(dim=-1)
