"""One episode, token-in-token-out: render → sample → parse → step → record, until done.

The episode's token list only grows. Sampled tokens are kept exactly as sampled (mask 1,
with their logprobs and policy versions); everything else — the opening prompt, tool
results, template glue, the next generation prompt — is forced (mask 0). Earlier turns are
never decoded and re-encoded.

How an episode ends (``Episode.truncation``):
- ``None``: the env returned ``terminated=True``;
- ``ENV``: the env returned ``truncated=True`` (or raised, under ``env_errors="truncate"``);
- ``MAX_TURNS``: ``max_turns`` assistant turns passed without the env ending the episode;
- ``CONTEXT_OVERFLOW``: the next turn could not fit ``max_model_length`` (a turn cut short by
  the context budget, or tool results that would not fit);
- ``PARSE_FAILURE``: the sampled message could not be parsed; the reward is
  ``failed_parse_reward``. A turn cut at ``max_tokens_per_turn`` is parsed as it is (the
  codec closes it): it is a parse failure only if it does not parse.

Reward and metrics come from the step that ends the episode; when the loop ends it, from the
env's last step (usually 0.0 and no metrics). ``close()`` runs on every path.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, TypeVar

from post_training_cookbook.codecs import Codec
from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.types import Message

T = TypeVar("T")


class TruncationCause(enum.Enum):
    CONTEXT_OVERFLOW = "context_overflow"
    MAX_TURNS = "max_turns"
    ENV = "env"
    PARSE_FAILURE = "parse_failure"


class Sampler(Protocol):
    """What the rollout needs from a model: the engine and the service both provide it."""

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]: ...


EnvErrorPolicy = Literal["raise", "truncate"]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_model_length: int
    max_tokens_per_turn: int
    failed_parse_reward: float = 0.0
    env_step_timeout_s: float | None = 60.0
    """A ``reset``/``step``/``close`` that takes longer is an env error (None = no limit)."""
    env_errors: EnvErrorPolicy = "raise"
    """``"raise"``: an env exception stops the run, naming the task and the turn;
    ``"truncate"``: the episode ends as ``ENV`` and counts in ``env_error`` metrics."""


class EnvStepError(RuntimeError):
    """An env raised (or timed out) under ``env_errors="raise"``; says which task and turn."""


@dataclass
class Episode:
    task: Task
    tokens: list[int]
    mask: list[float]
    """1.0 on sampled tokens, 0.0 on forced ones."""
    sampler_logprobs: list[float]
    """Per token: the sampler's logprob of a sampled token; 0.0 on forced tokens."""
    versions: list[int]
    """Per token: the policy version that sampled it; -1 on forced tokens."""
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    truncation: TruncationCause | None = None
    num_turns: int = 0
    env_error: str | None = None
    length_capped_turns: int = 0
    """Turns cut at ``max_tokens_per_turn`` (not counting a context-budget cut)."""

    @property
    def terminated(self) -> bool:
        return self.truncation is None

    @property
    def start_version(self) -> int:
        sampled = [version for version in self.versions if version >= 0]
        return sampled[0] if sampled else -1

    def add_forced(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.mask += [0.0] * len(tokens)
        self.sampler_logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)

    def add_sampled(self, sequence: SampledSequence) -> None:
        self.tokens += sequence.tokens
        self.mask += [1.0] * len(sequence.tokens)
        self.sampler_logprobs += sequence.logprobs
        self.versions += _token_versions(sequence)


def _token_versions(sequence: SampledSequence) -> list[int]:
    versions = []
    segments = sorted(sequence.policy_segments, key=lambda segment: segment.start_token)
    for index in range(len(sequence.tokens)):
        current = [s.version for s in segments if s.start_token <= index]
        versions.append(current[-1] if current else -1)
    return versions


async def run_episode(
    task: Task,
    env_factory: Callable[[Task], Env],
    sampler: Sampler,
    codec: Codec,
    params: SamplingParams,
    limits: EpisodeLimits,
    seed: int | None = None,
) -> Episode:
    """Play one episode of ``task`` with a fresh env; ``close()`` runs however it ends.

    ``seed`` makes the episode's sampling repeatable (each turn gets its own derived seed)."""
    env = env_factory(task)
    turn = 0
    try:
        opening = await _guarded(env.reset(task), limits, task, "reset", turn)
        if isinstance(opening, str):
            return _env_failed(Episode(task, [], [], [], []), opening)
        episode = Episode(task, [], [], [], [], messages=list(opening))
        episode.add_forced(codec.render_prompt(opening, env.tool_specs))
        while True:
            if turn >= limits.max_turns:
                return _truncated(episode, TruncationCause.MAX_TURNS)
            budget = limits.max_model_length - len(episode.tokens)
            if budget < 1:
                return _truncated(episode, TruncationCause.CONTEXT_OVERFLOW)
            max_tokens = min(limits.max_tokens_per_turn, budget)
            turn_seed = params.seed if seed is None else derive_seed(seed, turn)
            turn_params = replace(params, max_tokens=max_tokens, seed=turn_seed)
            (sampled,) = await sampler.sample(episode.tokens, 1, turn_params)
            episode.add_sampled(sampled)
            turn += 1
            episode.num_turns = turn
            if sampled.stop_reason == "length" and max_tokens < limits.max_tokens_per_turn:
                return _truncated(episode, TruncationCause.CONTEXT_OVERFLOW)
            episode.length_capped_turns += sampled.stop_reason == "length"
            parsed = codec.parse(sampled.tokens)
            if parsed.message is None:
                episode.reward = limits.failed_parse_reward
                return _truncated(episode, TruncationCause.PARSE_FAILURE)
            seen = len(env.messages)
            result = await _guarded(env.step(parsed.message), limits, task, "step", turn)
            if isinstance(result, str):
                return _env_failed(episode, result)
            _record(episode, result)
            if result.terminated or result.truncated:
                return _truncated(episode, None if result.terminated else TruncationCause.ENV)
            new_messages = result.messages[seen + 1 :]
            extension = codec.render_extension(new_messages, sampled_tokens=sampled.tokens)
            if len(episode.tokens) + len(extension) >= limits.max_model_length:
                return _truncated(episode, TruncationCause.CONTEXT_OVERFLOW)
            episode.add_forced(extension)
    finally:
        await _close(env, limits, task, turn)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts``, stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _record(episode: Episode, result: StepResult) -> None:
    episode.messages = list(result.messages)
    episode.reward = float(result.reward)
    episode.metrics = dict(result.metrics)


def _truncated(episode: Episode, cause: TruncationCause | None) -> Episode:
    episode.truncation = cause
    return episode


def _env_failed(episode: Episode, error: str) -> Episode:
    episode.env_error = error
    episode.reward = 0.0
    episode.metrics = {}
    return _truncated(episode, TruncationCause.ENV)


async def _guarded(
    call: Awaitable[T], limits: EpisodeLimits, task: Task, what: str, turn: int
) -> T | str:
    """The call's result; under ``env_errors="truncate"`` an error becomes its description."""
    try:
        return await asyncio.wait_for(call, limits.env_step_timeout_s)
    except Exception as exc:
        if isinstance(exc, TimeoutError):
            error = f"env.{what} timed out after {limits.env_step_timeout_s}s"
        else:
            error = f"env.{what} raised {exc!r}"
        if limits.env_errors == "raise":
            raise EnvStepError(f"{error} on task {task.prompt!r}, turn {turn}") from exc
        return error


async def _close(env: Env, limits: EpisodeLimits, task: Task, turn: int) -> None:
    await _guarded(env.close(), limits, task, "close", turn)
