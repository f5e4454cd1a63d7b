"""What ``Decoder`` works on, beside the model: a ``Request`` (one ``sample`` call), its
``Row`` per sequence being sampled, a prefill's distinct prompts (``PrefillPrompt``), the
engine's counters (``EngineStats``), and ``settle``, which resolves a caller's future from the
engine's thread."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from post_training_cookbook.engine.recurrent import RowState
from post_training_cookbook.engine.router_replay import RowRoutes
from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams
from post_training_cookbook.models.moe_routing import RoutedExperts

StopReason = Literal["stop", "length"]
_UNIFORM_CHUNK = 64


@dataclass
class EngineStats:
    """Counters since construction; ``LocalEngine.stats()`` returns a snapshot."""

    prefill_tokens_computed: int = 0  # prompt tokens run through the model
    prefill_tokens_reused: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_tokens_shared: int = 0  # prompt tokens of rows that copied an identical prompt's row
    prefix_cache_hits: int = 0  # prefilled prompts that reused at least one cached token
    prefix_cache_misses: int = 0
    prefix_cache_entries: int = 0
    prefill_batches: int = 0  # prefill forwards
    decode_steps: int = 0  # decode forwards
    decode_tokens: int = 0  # rows summed over decode steps
    max_decode_batch_size: int = 0
    sequences_finished: int = 0
    weight_updates: int = 0  # updates applied
    prefill_seconds: float = 0.0  # wall-clock in prefill (shared prefixes included)
    decode_seconds: float = 0.0  # wall-clock in decode steps

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed a second of prefill (reused and shared ones not counted)."""
        return self.prefill_tokens_computed / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def mean_decode_batch_size(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def to_metrics(self) -> dict[str, float]:
        metrics = {f"engine/{name}": float(value) for name, value in asdict(self).items()}
        metrics["engine/mean_decode_batch_size"] = self.mean_decode_batch_size
        metrics["engine/prefill_tokens_per_s"] = self.prefill_tokens_per_s
        metrics["engine/decode_tokens_per_s"] = self.decode_tokens_per_s
        return metrics


@dataclass(eq=False)
class Request:
    """One ``sample`` call: resolved on its caller's loop once all ``n`` sequences finish."""

    prompt: list[int]
    n: int
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[SampledSequence]]
    cancelled: bool = False  # set on the loop when the caller stops waiting
    sequences: dict[int, SampledSequence] = field(default_factory=dict)
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)

    def complete(self, index: int, sequence: SampledSequence) -> None:
        self.sequences[index] = sequence
        if len(self.sequences) == self.n:
            settle(self.loop, self.future, result=[self.sequences[i] for i in range(self.n)])

    def fail(self, error: BaseException) -> None:
        settle(self.loop, self.future, error=error)


@dataclass(eq=False)
class Row:
    """One sequence being sampled."""

    request: Request
    index: int  # which of the request's n samples
    generator: torch.Generator  # the row's own when seeded, else the engine's
    max_tokens: int
    segments: list[PolicySegment]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    uniforms: list[float] = field(default_factory=list)
    routes: RowRoutes | None = None  # router replay: the experts each token went to

    def next_uniform(self) -> float:
        # Drawn in chunks: cheap per token, bounded memory, and still a function of the seed only.
        step = len(self.tokens) % _UNIFORM_CHUNK
        if step == 0:
            self.uniforms = torch.rand(_UNIFORM_CHUNK, generator=self.generator).tolist()
        return self.uniforms[step]

    def stop_reason(self) -> StopReason | None:
        if self.tokens[-1] in self.request.stop_ids:
            return "stop"
        return "length" if len(self.tokens) >= self.max_tokens else None

    def switch_to(self, version: int) -> None:
        start = len(self.tokens)  # the first token the new weights will sample
        if self.segments[-1].start_token == start:
            self.segments[-1] = PolicySegment(start, version)
        else:
            self.segments.append(PolicySegment(start, version))

    def to_sequence(self, reason: StopReason) -> SampledSequence:
        routes = None if self.routes is None else self.routes.sequence()
        return SampledSequence(
            self.tokens, self.logprobs, reason, self.segments, self.raw_logprobs, routes
        )


@dataclass(eq=False)
class PrefillPrompt:
    """One distinct prompt of a prefill, with every sample that asked for it."""

    tokens: list[int]
    samples: list[tuple[Request, int]] = field(default_factory=list)
    reused: int = 0  # leading tokens whose KV comes from the prefix cache
    past: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    state: RowState | None = None  # a hybrid model's recurrent state after the reused tokens
    routes: RoutedExperts | None = None  # router replay: the cached part's, then the whole's

    @property
    def suffix(self) -> list[int]:
        return self.tokens[self.reused :]


def settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Resolve ``future`` on its own loop, from any thread."""

    def resolve() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits the future any more
        loop.call_soon_threadsafe(resolve)
