"""Play episodes, token-in-token-out: render → sample → parse → step → record, until done.

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

A group is ``num_episodes`` episodes of one task played concurrently; the engine batches the
turns of every episode in flight, so groups are played concurrently too.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.rollout.types import (
    EnvStepError,
    Episode,
    EpisodeLimits,
    Group,
    Sampler,
    TruncationCause,
)

if TYPE_CHECKING:
    from post_training_cookbook.codecs import Codec

T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeRunner:
    """Everything needed to play an episode, fixed once per run."""

    env_factory: Callable[[Task], Env]
    sampler: Sampler
    codec: Codec
    limits: EpisodeLimits


async def play_group(
    runner: EpisodeRunner,
    task: Task,
    num_episodes: int,
    params: SamplingParams,
    seed: int | None = None,
) -> Group:
    """``num_episodes`` episodes of ``task``, concurrently; ``seed`` makes them repeatable
    (each episode gets its own derived seed, so they still differ from each other)."""

    def play_episode(index: int) -> Awaitable[Episode]:
        episode_seed = None if seed is None else derive_seed(seed, index)
        return run_episode(task, runner, params, episode_seed)

    episodes = await asyncio.gather(*(play_episode(index) for index in range(num_episodes)))
    return Group(task, list(episodes))


async def play_groups(
    runner: EpisodeRunner,
    tasks: Sequence[Task],
    num_episodes: int,
    params: SamplingParams,
    seeds: Sequence[int | None] | None = None,
) -> list[Group]:
    """One group per task, all concurrently."""
    group_seeds = list(seeds) if seeds is not None else [None] * len(tasks)
    groups = await asyncio.gather(
        *(
            play_group(runner, task, num_episodes, params, seed)
            for task, seed in zip(tasks, group_seeds, strict=True)
        )
    )
    return list(groups)


async def run_episode(
    task: Task, runner: EpisodeRunner, params: SamplingParams, seed: int | None = None
) -> Episode:
    """Play one episode of ``task`` with a fresh env; ``close()`` runs however it ends.

    ``seed`` makes the episode's sampling repeatable (each turn gets its own derived seed)."""
    codec, limits = runner.codec, runner.limits
    env = runner.env_factory(task)
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
            (sampled,) = await runner.sampler.sample(episode.tokens, 1, turn_params)
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
        await _guarded(env.close(), limits, task, "close", turn)


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
