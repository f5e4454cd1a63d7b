"""Groups of episodes (one task, several episodes) and the numbers that describe them.

The training loop, validation and evaluation all play groups with ``play_group`` and
summarise them with ``episode_metrics``, so a number means the same thing everywhere.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from post_training_cookbook.codecs import Codec
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.rollout import (
    Episode,
    EpisodeLimits,
    Sampler,
    TruncationCause,
    derive_seed,
    run_episode,
)


@dataclass
class Group:
    task: Task
    episodes: list[Episode]

    @property
    def rewards(self) -> list[float]:
        return [episode.reward for episode in self.episodes]

    @property
    def has_reward_variance(self) -> bool:
        return len(set(self.rewards)) > 1


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

    def one(index: int) -> Awaitable[Episode]:
        episode_seed = None if seed is None else derive_seed(seed, index)
        return run_episode(
            task,
            runner.env_factory,
            runner.sampler,
            runner.codec,
            params,
            runner.limits,
            episode_seed,
        )

    episodes = await asyncio.gather(*(one(index) for index in range(num_episodes)))
    return Group(task, list(episodes))


async def play_groups(
    runner: EpisodeRunner,
    tasks: Sequence[Task],
    num_episodes: int,
    params: SamplingParams,
    seeds: Sequence[int | None] | None = None,
) -> list[Group]:
    """All groups concurrently (the engine batches their turns together)."""
    group_seeds = list(seeds) if seeds is not None else [None] * len(tasks)
    groups = await asyncio.gather(
        *(
            play_group(runner, task, num_episodes, params, seed)
            for task, seed in zip(tasks, group_seeds, strict=True)
        )
    )
    return list(groups)


def episode_metrics(groups: Sequence[Group], prefix: str = "rollout/") -> dict[str, float]:
    """Rewards, how episodes ended, turns, tool use and lengths, and the env's final metrics
    (mean per key), under ``prefix``."""
    episodes = [episode for group in groups for episode in group.episodes]
    if not episodes:
        return {}
    count = len(episodes)
    rewards = [episode.reward for episode in episodes]
    turns = sum(episode.num_turns for episode in episodes)
    causes = [episode.truncation for episode in episodes]
    metrics = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "terminated_ratio": sum(cause is None for cause in causes) / count,
        "truncated_ratio": sum(cause is not None for cause in causes) / count,
        "parse_rate": 1 - causes.count(TruncationCause.PARSE_FAILURE) / max(1, turns),
        "length_capped": sum(e.length_capped_turns > 0 for e in episodes) / count,
        "env_error_ratio": sum(e.env_error is not None for e in episodes) / count,
        "reward_variance_share": sum(g.has_reward_variance for g in groups) / len(groups),
        "turns_per_episode": turns / count,
        "tokens_per_episode": statistics.fmean(len(e.tokens) for e in episodes),
        "sampled_tokens_per_episode": statistics.fmean(sum(e.mask) for e in episodes),
    }
    for cause in TruncationCause:
        key = "env_truncated_ratio" if cause is TruncationCause.ENV else f"{cause.value}_ratio"
        metrics[key] = causes.count(cause) / count
    for key, values in _env_metric_values(episodes).items():
        metrics[f"env/{key}"] = statistics.fmean(values)
    return {prefix + key: value for key, value in metrics.items()}


def _env_metric_values(episodes: Sequence[Episode]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for key, value in episode.metrics.items():
            values.setdefault(key, []).append(float(value))
    return values
