"""The trainer's records: training samples in, loss and step results out, and its settings.

A ``TrainingSample`` is one whole episode (or one SFT conversation), token-aligned: position
``i`` describes ``tokens[i]`` predicted from ``tokens[:i]``, so position 0 (nothing to predict
from) is always masked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from post_training_cookbook.models.moe_routing import RoutedExperts

Precision = Literal["fp32", "bf16"]
"""The trainer's weights: fp32 (with fp32 gradients and AdamW state), or bf16 weights and
gradients with an fp32 master copy and moments in the optimizer (``trainer/precision.py``)."""

PackingMode = Literal["off", "packed", "shared_prefix"]
"""How the trainer lays out a micro-batch (``trainer/packing.py``): padded rows; one token
stream without padding; or a stream where each prefix that samples share appears once."""

LossType = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
"""The policy-gradient losses (``GRPOConfig.loss_type``)."""
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
SFT_LOSS: Literal["sft"] = "sft"
"""Supervised fine-tuning's loss: the mean NLL over the batch's trained tokens. The trainer
takes it like any loss; GRPO's configs do not offer it (``LossType`` stays the RL losses)."""
TRAINER_LOSS_TYPES: tuple[str, ...] = (*LOSS_TYPES, SFT_LOSS)
AdvantageNormalization = Literal["mean", "mean_std"]
"""How a group's rewards become advantages (``objective.group_advantages``): minus the
group's mean, and divided by its std under ``"mean_std"``."""
TurnRewards = Literal["final", "per_step"]
"""Which rewards a group compares (``grpo/advantages.py``): each episode's final one, or each
turn's return."""


@dataclass
class TrainingSample:
    tokens: list[int]
    """The whole episode: prompt, sampled turns, tool results, template glue."""
    mask: list[float]
    """1.0 on sampled (trained) tokens, 0.0 on forced ones; ``mask[0]`` must be 0."""
    sampler_logprobs: list[float]
    """Behaviour-policy log p of each token, as recorded when it was sampled; 0 where mask 0."""
    advantages: list[float]
    """Per-token advantage (usually the episode's on every sampled token); 0 where mask 0."""
    routed_experts: RoutedExperts | None = None
    """Router replay (``models/moe_routing.py``): int16 ``[len(tokens), moe_layers, top_k]``,
    the experts the sampler's routers chose for each token (-1 where none recorded it). A
    trainer built with ``router_replay`` routes each recorded token through them; None: its
    own router routes every token."""

    def __post_init__(self) -> None:
        length = len(self.tokens)
        if length == 0:
            raise ValueError("tokens is empty")
        for name in ("mask", "sampler_logprobs", "advantages"):
            if len(getattr(self, name)) != length:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries but tokens has {length}"
                )
        if self.mask[0] != 0.0:
            raise ValueError("mask[0] must be 0: the first token has no context to predict it")
        if any(m < 0.0 for m in self.mask):
            raise ValueError("mask entries must be >= 0")
        routes = self.routed_experts
        if routes is not None and (routes.ndim != 3 or len(routes) != length):
            raise ValueError(
                f"routed_experts must be [tokens={length}, moe_layers, top_k], got {routes.shape}"
            )

    @property
    def num_trained_tokens(self) -> int:
        return sum(1 for m in self.mask if m > 0.0)


@dataclass(frozen=True)
class LossConfig:
    """Which policy-gradient loss to use and its knobs; formulas in ``docs/losses.md``."""

    loss_type: LossType | Literal["sft"] = "grpo"
    clip_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_low`` (CISPO has no lower clip and ignores it)."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high``: DAPO's clip-higher uses 0.28, GSPO ~4e-4,
    CISPO caps its stop-gradient weight at ``1 + clip_high`` (MiniMax-M1 tunes it much larger)."""
    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to a frozen reference policy; 0 turns it off."""
    tis_cap: float | None = None
    """Truncated importance sampling: when set, ratios are taken against the trainer's own
    pre-update log-probabilities and every term is weighted by
    ``min(exp(logp_trainer_old - logp_sampler), tis_cap)`` (stop-gradient). None turns it off."""
    dr_grpo_horizon: int | None = None
    """Dr. GRPO's fixed horizon: the per-sequence token sum is divided by it. None uses the
    largest number of trained tokens of any sequence in the batch; set it to the generation
    budget (e.g. max_turns × max_tokens) for a constant that does not move between batches."""

    def __post_init__(self) -> None:
        if self.loss_type not in TRAINER_LOSS_TYPES:
            raise ValueError(
                f"loss_type must be one of {TRAINER_LOSS_TYPES}, got {self.loss_type!r}"
            )
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"clip_low must be in [0, 1], got {self.clip_low}")
        if not 0.0 <= self.clip_high < math.inf:
            raise ValueError(f"clip_high must be a finite value >= 0, got {self.clip_high}")
        if not 0.0 <= self.kl_beta < math.inf:
            raise ValueError(f"kl_beta must be a finite value >= 0, got {self.kl_beta}")
        if self.tis_cap is not None and not 0.0 < self.tis_cap < math.inf:
            raise ValueError(f"tis_cap must be a finite value > 0 or None, got {self.tis_cap}")
        if self.dr_grpo_horizon is not None and self.dr_grpo_horizon < 1:
            raise ValueError(f"dr_grpo_horizon must be >= 1 or None, got {self.dr_grpo_horizon}")


@dataclass(frozen=True)
class RouterCounts:
    """Router replay's counts over one batch (``trainer/router_replay.py``)."""

    replayed_tokens: int
    """Tokens the decoder read with a recorded routing (a prefix read once counts once)."""
    routed_otherwise: int
    """Of those, tokens whose top-k experts the trainer's own routers would have chosen
    otherwise in some MoE layer."""

    @property
    def disagreement(self) -> float:
        """The share of replayed tokens routed otherwise (0 when sampler and trainer agree)."""
        return self.routed_otherwise / max(self.replayed_tokens, 1)


@dataclass(frozen=True)
class ForwardBackwardResult:
    loss: float
    """The batch loss (the sum of the micro-batches' shares, each already batch-normalised)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss's diagnostics (``loss/…``), each a mean over the batch's trained tokens; the
    counts below are fields, not entries here."""
    num_tokens: int = 0
    """Trained (mask > 0) tokens in the batch."""
    forwarded_tokens: int = 0
    """Token positions the model computed: padding counts, a prefix that samples in one
    micro-batch share counts once. Unlike ``metrics``, it depends on the layout: against
    the samples' own lengths it shows what padding cost and prefix sharing saved."""
    router: RouterCounts | None = None
    """With router replay (``TrainerSettings.router_replay``); None without."""


@dataclass(frozen=True)
class BatchSums:
    """What ``forward_backward`` adds up over its micro-batches, and a sharded trainer over
    its ranks, before any of it becomes a mean."""

    loss: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)
    """Each metric's micro-batch mean times its trained tokens (exact token weighting)."""
    routed_otherwise: int = 0
    """Router replay: recorded tokens our own routers would have sent elsewhere."""
    routes_recorded: int = 0
    forwarded_tokens: int = 0

    def __add__(self, other: BatchSums) -> BatchSums:
        metric_sums = dict(self.metric_sums)
        for key, value in other.metric_sums.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value
        return BatchSums(
            self.loss + other.loss,
            metric_sums,
            self.routed_otherwise + other.routed_otherwise,
            self.routes_recorded + other.routes_recorded,
            self.forwarded_tokens + other.forwarded_tokens,
        )


@dataclass(frozen=True)
class OptimStepResult:
    version: int
    """Policy version after the step: 0 = initial weights, +1 per applied step."""
    grad_norm: float
    """Total gradient norm before clipping (nan/inf when the step was skipped for that)."""
    skipped: bool
    """True when a non-finite loss or gradient made the step a no-op."""
    learning_rate: float
    """The learning rate the step was given (applied unless ``skipped``)."""


def token_rows_problem(tokens: Sequence[str], use_lora: bool, sharded: bool) -> str | None:
    """Why ``trainable_tokens`` cannot apply to this trainer, or None (the config's rule and
    the trainer both ask)."""
    if tokens and not use_lora:
        return "trainable_tokens is for LoRA (use_lora=True): full-weight training trains every row"
    if tokens and sharded:
        return (
            "trainable_tokens is not supported by the sharded trainer (num_trainer_workers > 1) yet"
        )
    return None


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainerSettings:
    """What a ``Trainer`` is built with, besides its model: ``Trainer(model, settings)``.

    ``GRPOConfig`` and ``SFTConfig`` fields of the same names set them for a run
    (``runs/models.trainer_settings``); a recorded batch keeps them. Memory formulas and a
    table per model size: ``docs/models.md``.
    """

    # ---- what trains: full weight, or a LoRA adapter (``trainer/lora.py``)
    use_lora: bool = True
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    trainable_tokens: tuple[str, ...] = ()
    """With LoRA: tokens, as the vocabulary spells them, whose embedding and LM-head rows
    train in full beside the adapter (``token_rows.py``)."""

    # ---- the optimizer: AdamW (the learning rate comes with each ``optim_step``)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    """None turns clipping off."""

    # ---- precision (``trainer/precision.py``)
    precision: Precision = "fp32"
    """``"fp32"``, or ``"bf16"`` weights and gradients with an fp32 master copy and moments
    in the optimizer."""
    autocast_bf16: bool | None = None
    """None: bf16 autocast where the hardware makes it fast (with fp32 weights)."""

    # ---- micro-batches and memory (``trainer/memory_plan.py``, ``trainer/packing.py``)
    micro_batch_tokens: int | None = 4096
    """A micro-batch's padded size (rows × longest row), or with packing a stream's tokens; a
    longer sample gets its own, and rows under 3/4 of a micro-batch's longest start another.
    None: from the memory plan."""
    gradient_checkpointing: bool | None = False
    """Recompute each decoder layer in backward (off: small models on a CPU are short of
    time, not memory). None: from the memory plan."""
    memory_budget: float = 0.5
    """Share of the device's free memory the memory plan may fill with activations."""
    logprob_chunk_tokens: int | Literal["auto"] | None = "auto"
    """Trained positions whose vocabulary-sized log-softmax exists at once (None: all;
    ``"auto"``: sized by the vocabulary, ``memory_plan.auto_logprob_chunk_tokens``)."""
    packing: bool = True
    """Micro-batches as token streams without padding, on only for models where that is
    exact (Gated DeltaNet hybrids included, ``linear_attention.py``)."""
    shared_prefix: bool = True
    """With packing, forward each prefix that samples share once (a group's prompt)."""

    # ---- the loss's needs
    reference_model: bool = False
    """Keep the initial policy for the KL term (needed by ``kl_beta > 0``): a frozen copy for
    full weight, the base with the adapter disabled for LoRA (no copy)."""
    router_replay: bool = False
    """MoE models: route each token a sample's ``routed_experts`` records through those
    experts (``trainer/router_replay.py``; a ValueError for a model without MoE routers it
    knows, ``models/moe_routing.py``)."""

    # ---- where and from what seed
    seed: int | None = None
    """Seeds torch before the model loads (LoRA's A matrices are initialised at random)."""
    device: str | None = None
    """``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; None: CUDA when present, else the CPU."""
