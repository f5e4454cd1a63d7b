"""The records that cross the engine's edge: how to sample, and what one sample is.

Log-probabilities are always those of the distribution the token was actually drawn from:
temperature first, then top-k, then top-p, renormalised. Greedy sampling (temperature 0)
draws from nothing, so its log-probabilities are those of the untempered, unfiltered
softmax (temperature 1). A trainer that compares sampler and learner log-probabilities at
temperature 1 gets equal numbers only for temperature-1, unfiltered sampling; for anything
else it should use ``raw_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import numpy as np

MIN_TEMPERATURE = 1e-3
"""The lowest temperature above 0 that sampling takes: logits divided by much less overflow
to infinity (NaN log-probabilities, the same token every time). Below it, use 0 (greedy)."""
MIN_TOP_P = 1e-6
"""The lowest ``top_p``: a smaller one keeps only the most likely token, as this one does."""


def temperature_problem(value: float) -> str | None:
    """Why ``value`` is no sampling temperature, or None when it is one."""
    if not value >= 0.0:  # also rejects NaN
        return f"must be >= 0, got {value}"
    if 0.0 < value < MIN_TEMPERATURE:
        return f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {value:g}"
    if value == float("inf"):
        return f"must be finite, got {value}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion; ``ValueError`` names the field that is out of range."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop token ends the sequence and is kept
    seed: int | None = None  # same seed, same prompt, same weights: same tokens, whatever else runs

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if (problem := temperature_problem(self.temperature)) is not None:
            raise ValueError(f"temperature {problem}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")


@dataclass(frozen=True)
class PolicySegment:
    """Tokens from index ``start_token`` of ``SampledSequence.tokens`` on came from ``version``."""

    start_token: int
    version: int


@dataclass
class SampledSequence:
    """One completion. ``policy_segments`` has one entry unless weights changed mid-sequence."""

    tokens: list[int]  # sampled ids, the stop token included when one was hit
    logprobs: list[float]  # log p of each token under the distribution it was sampled from
    stop_reason: Literal["stop", "length"]
    policy_segments: list[PolicySegment]
    # log p of each token under the plain softmax of the logits (temperature 1, no top-k/top-p)
    # of the weights that sampled it; empty when the engine does not report it.
    raw_logprobs: list[float] = field(default_factory=list)
    # Router replay (``models/moe_routing.py``): int16 [len(prompt) + len(tokens), moe_layers,
    # top_k], the experts each MoE layer's router chose for each token as the sampler read it
    # (-1: never read, as the last sampled token); None when the engine did not record.
    routed_experts: np.ndarray | None = None


WeightsMode = Literal["pipeline", "drain"]
"""How an engine applies new weights. ``"pipeline"``: between two decode steps; sequences in
flight go on under the new weights. ``"drain"``: once the sequences in flight have finished
under the old ones; new requests wait until then."""


class _WeightsUpdate(Protocol):
    @property
    def mode(self) -> WeightsMode: ...


Update = TypeVar("Update", bound=_WeightsUpdate)


def due_update(pending: Update | None, live: bool) -> tuple[Update | None, Update | None]:
    """Split an engine's pending weights update into (the one to apply now, the one still
    pending), given whether sequences are live. While a drain update is still pending, the
    engine admits no new request, so that the sequences in flight can finish."""
    if pending is not None and (pending.mode == "pipeline" or not live):
        return pending, None
    return None, pending
