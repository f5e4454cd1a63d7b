"""What a GRPO step optimises, top to bottom: group rewards → advantages → per-token terms → loss.

    1. advantages  A_i = (R_i − mean_j R_j) / std_j R_j over one group's episodes,
                   every sampled token of episode i gets A_i         ``group_advantages``
    2. ratio       r_t = exp(log π_θ − log π_old) on each trained token   ``policy_loss``
    3. terms       ℓ_t = −min(r_t·A_t, clip(r_t, 1−ε_low, 1+ε_high)·A_t)   ``ppo_clip``
                   × w_t (TIS), + β·k3_t (KL to a frozen reference)
    4. loss        L = (1/G) Σ_i (1/|o_i|) Σ_{t∈o_i} ℓ_t                   ``sequence_mean``

``policy_loss`` is steps 2-4 for every variant; a variant is a row of ``VARIANTS``, which
swaps the term of step 3 or the aggregation of step 4:

- DAPO:     GRPO's term, mean over every trained token of the batch (``token_mean``);
            use it with clip-higher, ε_high = 0.28.
- Dr. GRPO: GRPO's term, each sequence's sum over a fixed horizon (``fixed_horizon``); its
            other half, no division by the std in step 1, is ``normalization="mean"``.
- GSPO:     GRPO's term and aggregation on one length-normalised ratio and advantage per
            sequence (``sequence_level``); ε ≈ 3e-4 / 4e-4.
- CISPO:    REINFORCE with a capped stop-gradient ratio as the weight (``cispo``), token mean.
- TIS:      (``tis_cap``) π_old is the trainer before this step, and each term is weighted
            by min(π_trainer_old / π_sampler, cap) (``behaviour_policy``).
- KL:       (``kl_beta``) β times the k3 estimate of KL(π_θ ‖ π_ref) per token (``k3_kl``).

SFT's loss (``sft_loss``) sits at the end: the NLL of the trained tokens, step 4's token mean.

Around it: the loop's phase 2 (``grpo/lockstep.py``) shapes the rewards, skips groups whose
rewards do not vary and turns episodes into samples (``grpo/advantages.py``, which calls
``group_advantages``); distillation adds a teacher's per-token advantage
(``distill/advantages.py``); the trainer's ``forward_backward`` computes log π_θ of each
micro-batch and calls the ``LossFn`` that ``get_loss_fn`` names.

A loss takes per-token ``[batch, time]`` tensors aligned with ``TrainingSample`` (position
``t`` scores ``tokens[t]``) and returns ``(loss, metrics)``:

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

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from post_training_cookbook.trainer.types import (
    LOSS_TYPES,
    SFT_LOSS,
    TRAINER_LOSS_TYPES,
    AdvantageNormalization,
    LossConfig,
)

Metrics = dict[str, float]

# ---------------------------------------------------------------- 1. advantages

STD_FLOOR = 1e-6
"""A group's std is at least this, so a near-constant group's advantages stay finite."""


def group_advantages(
    rewards: Sequence[float], normalization: AdvantageNormalization
) -> list[float]:
    """Each reward minus the group's mean, divided by the group's std under ``"mean_std"``."""
    mean = statistics.fmean(rewards)
    centered = [reward - mean for reward in rewards]
    if normalization == "mean_std":
        std = max(statistics.pstdev(rewards), STD_FLOOR)
        return [value / std for value in centered]
    return centered


# ---------------------------------------------------------------- 2-4. the loss


def policy_loss(
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
    """This micro-batch's share of the batch's policy-gradient loss, for the variant
    ``config.loss_type`` names (steps 2-4 of the module's doc)."""
    variant = VARIANTS[config.loss_type]
    totals = totals or BatchTotals.of(mask)
    # 2. the ratio to π_old (the sampler; with TIS the trainer before this step)
    old, log_tis = behaviour_policy(logprobs, sampler_logprobs, trainer_old_logprobs, config)
    log_ratio = logprobs - old
    if variant.sequence_level:  # GSPO: each sequence's mean, on every one of its tokens
        log_ratio, advantages = on_every_token(log_ratio, mask), on_every_token(advantages, mask)
        log_tis = on_every_token(log_tis, mask) if log_tis is not None else None
    # 3. the per-token terms, TIS-weighted, plus the KL to the reference
    terms, metrics = variant.terms(logprobs, log_ratio, advantages, mask, config)
    if log_tis is not None:
        tis = torch.exp(log_tis).clamp(max=config.tis_cap)
        terms = terms * tis
        metrics["loss/tis_weight_mean"] = masked_mean(tis, mask)
    if config.kl_beta > 0:
        kl = k3_kl(logprobs, reference_logprobs)
        terms = terms + config.kl_beta * kl
        metrics["loss/kl_ref"] = masked_mean(kl.detach(), mask)
    metrics["loss/sampler_trainer_abs_diff"] = masked_mean(
        (sampler_logprobs - logprobs.detach()).abs(), mask
    )
    # 4. the terms, aggregated into this micro-batch's share of the batch's loss
    return variant.aggregate(terms, mask, totals, config), metrics


# ---------------------------------------------------------------- 3. the terms


def ppo_clip(
    logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, config: LossConfig
) -> tuple[Tensor, Metrics]:
    """GRPO's term: ℓ_t = −min(r_t·A_t, clip(r_t, 1−ε_low, 1+ε_high)·A_t). Where the clip
    is active, ℓ_t is constant in θ: the clip fractions count those tokens."""
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    terms = -torch.minimum(ratio * advantages, clipped * advantages)
    ratio = ratio.detach()
    low = (ratio < 1.0 - config.clip_low) & (advantages < 0)
    high = (ratio > 1.0 + config.clip_high) & (advantages > 0)
    return terms, {
        "loss/clip_low_fraction": masked_mean(low.float(), mask),
        "loss/clip_high_fraction": masked_mean(high.float(), mask),
    }


def cispo(
    logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, config: LossConfig
) -> tuple[Tensor, Metrics]:
    """CISPO's term: ℓ_t = −sg(min(r_t, 1+ε_high))·A_t·log π_θ. No token is dropped; a capped
    token's gradient shrinks but stays non-zero (``loss/clip_high_fraction`` counts them).
    ``clip_low`` is unused: CISPO has no lower bound."""
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(max=1.0 + config.clip_high)
    return -weight * advantages * logprobs, {
        "loss/clip_low_fraction": 0.0,
        "loss/clip_high_fraction": masked_mean((ratio > 1.0 + config.clip_high).float(), mask),
    }


def behaviour_policy(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    trainer_old_logprobs: Tensor | None,
    config: LossConfig,
) -> tuple[Tensor, Tensor | None]:
    """The log π_old that ratios are taken against, and TIS's log-weight (None without TIS).

    Without TIS, π_old is the sampler. With TIS the ratio is taken against the trainer's
    pre-update policy and the sampler/trainer mismatch is carried by the capped weight alone;
    taking the ratio against the sampler as well would correct the mismatch twice.
    """
    if config.tis_cap is None:
        return sampler_logprobs, None
    trainer_old = logprobs.detach() if trainer_old_logprobs is None else trainer_old_logprobs
    return trainer_old, trainer_old - sampler_logprobs


def k3_kl(logprobs: Tensor, reference_logprobs: Tensor | None) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref): exp(d) − d − 1 with d = log π_ref − log π_θ."""
    if reference_logprobs is None:
        raise ValueError("kl_beta > 0 needs reference_logprobs")
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


# ---------------------------------------------------------------- 4. the aggregations
# Each divides by the whole batch's totals, so micro-batch shares sum to the batch's loss.


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


def sequence_mean(terms: Tensor, mask: Tensor, totals: BatchTotals, config: LossConfig) -> Tensor:
    """GRPO, GSPO: L = (1/G) Σ_i (1/|o_i|) Σ_{t∈o_i} ℓ_t; every sequence counts the same."""
    return per_sequence_means(terms, mask).sum() / max(totals.num_sequences, 1)


def token_mean(terms: Tensor, mask: Tensor, totals: BatchTotals, config: LossConfig) -> Tensor:
    """DAPO, CISPO: L = Σ_i Σ_{t∈o_i} ℓ_t / Σ_i |o_i|; every token counts the same."""
    return (terms * mask).sum() / max(totals.num_tokens, 1e-8)


def fixed_horizon(terms: Tensor, mask: Tensor, totals: BatchTotals, config: LossConfig) -> Tensor:
    """Dr. GRPO: L = (1/G) Σ_i Σ_{t∈o_i} ℓ_t / H, H = ``dr_grpo_horizon`` or the batch's
    largest |o_i|: no length bias."""
    horizon = config.dr_grpo_horizon or totals.max_sequence_tokens
    return (terms * mask).sum() / (max(totals.num_sequences, 1) * max(horizon, 1e-8))


# ---------------------------------------------------------------- the variants

Terms = Callable[[Tensor, Tensor, Tensor, Tensor, LossConfig], tuple[Tensor, Metrics]]
Aggregate = Callable[[Tensor, Tensor, BatchTotals, LossConfig], Tensor]


@dataclass(frozen=True)
class Variant:
    terms: Terms
    aggregate: Aggregate
    sequence_level: bool = False
    """One ratio, advantage and TIS weight per sequence: their means over its tokens."""


VARIANTS: dict[str, Variant] = {
    "grpo": Variant(ppo_clip, sequence_mean),
    "dapo": Variant(ppo_clip, token_mean),
    "dr_grpo": Variant(ppo_clip, fixed_horizon),
    "gspo": Variant(ppo_clip, sequence_mean, sequence_level=True),
    "cispo": Variant(cispo, token_mean),
}
assert set(VARIANTS) == set(LOSS_TYPES)


# ---------------------------------------------------------------- shared pieces


def masked_mean(values: Tensor, mask: Tensor) -> float:
    return float((values * mask).sum().item() / max(mask.sum().item(), 1e-8))


def per_sequence_means(values: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's mean of ``values`` over its trained tokens: ``[batch]``."""
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1e-8)


def on_every_token(values: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level values: each sequence's mean, on each of its positions."""
    return per_sequence_means(values, mask)[:, None].expand_as(mask)


def token_entropy(logprobs_over_vocab: Tensor) -> Tensor:
    """Entropy −Σ_v p_v log p_v of each row of log-probabilities over the vocabulary."""
    return -(logprobs_over_vocab.exp() * logprobs_over_vocab).sum(dim=-1)


# ---------------------------------------------------------------- SFT


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
    packed rows later). ``sampler_logprobs``, ``advantages``, TIS, KL and the clip settings
    are unused.
    """
    totals = totals or BatchTotals.of(mask)
    loss = token_mean(-logprobs, mask, totals, config)
    return loss, {"loss/nll": -masked_mean(logprobs.detach(), mask)}


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


LOSS_FNS: dict[str, LossFn] = {loss_type: policy_loss for loss_type in LOSS_TYPES}
LOSS_FNS[SFT_LOSS] = sft_loss
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
