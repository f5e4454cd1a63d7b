"""The numbers that describe groups of episodes, and the one rule for reward variance.

The training loop, validation and evaluation all summarise their groups with
``episode_metrics``, so a number means the same thing everywhere.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from post_training_cookbook.envs.mixture import env_name
from post_training_cookbook.rollout.types import Episode, Group, TruncationCause

RewardOf = Callable[[Episode], float]
"""The reward a group's episodes are compared on: the env's, or GRPO's shaped reward."""


def env_reward(episode: Episode) -> float:
    return episode.reward


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ: only then does GRPO learn from it (its advantages
    are all zero otherwise). The skip and the ``reward_variance_share`` metric both ask this."""
    return bool(rewards) and max(rewards) > min(rewards)


def episode_metrics(
    groups: Sequence[Group], prefix: str = "rollout/", reward_of: RewardOf = env_reward
) -> dict[str, float]:
    """Rewards, how episodes ended, turns, tool use and lengths, and the env's final metrics
    (mean per key), under ``prefix``. ``reward_variance_share`` compares ``reward_of`` within
    each group (GRPO passes its shaped reward, so the share is of the groups it trains on).
    A hosted model's episodes hold no tokens of ours: the endpoint's own counts replace the
    token counts, as ``endpoint_tokens_per_episode`` and
    ``endpoint_completion_tokens_per_episode``, so that no number pretends to compare."""
    episodes = [episode for group in groups for episode in group.episodes]
    if not episodes:
        return {}
    count = len(episodes)
    rewards = [episode.reward for episode in episodes]
    turns = sum(episode.num_turns for episode in episodes)
    causes = [episode.truncation for episode in episodes]
    varied = [has_reward_variance([reward_of(e) for e in group.episodes]) for group in groups]
    metrics = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "terminated_ratio": sum(cause is None for cause in causes) / count,
        "truncated_ratio": sum(cause is not None for cause in causes) / count,
        "parse_rate": 1
        - (causes.count(TruncationCause.PARSE_FAILURE) + sum(e.unparsed_turns for e in episodes))
        / max(1, turns),
        "length_capped": sum(e.length_capped_turns > 0 for e in episodes) / count,
        "env_error_ratio": sum(e.env_error is not None for e in episodes) / count,
        "env_close_error_ratio": sum(e.close_error is not None for e in episodes) / count,
        "env_retries": float(sum(e.env_retries for e in episodes)),
        "reward_variance_share": sum(varied) / len(groups),
        "turns_per_episode": turns / count,
        "tokens_per_episode": statistics.fmean(len(e.tokens) for e in episodes),
        "sampled_tokens_per_episode": statistics.fmean(e.num_sampled_tokens for e in episodes),
    }
    hosted = [e.endpoint_usage for e in episodes if e.endpoint_usage is not None]
    if hosted:  # a hosted model's tokens are not ours: its counts get their own names
        del metrics["tokens_per_episode"], metrics["sampled_tokens_per_episode"]
        metrics["endpoint_tokens_per_episode"] = statistics.fmean(u.context_tokens for u in hosted)
        metrics["endpoint_completion_tokens_per_episode"] = statistics.fmean(
            u.completion_tokens for u in hosted
        )
    for cause in TruncationCause:
        key = "env_truncated_ratio" if cause is TruncationCause.ENV else f"{cause.value}_ratio"
        metrics[key] = causes.count(cause) / count
    for key, values in _env_metric_values(episodes).items():
        metrics[f"env/{key}"] = statistics.fmean(values)
    return {prefix + key: value for key, value in metrics.items()}


def per_env_metrics(
    groups: Sequence[Group], prefix: str = "rollout/", reward_of: RewardOf = env_reward
) -> dict[str, float]:
    """``episode_metrics`` of each env's groups under ``<prefix><env>/``, with the env's
    group count, for tasks that name their env (a mixture's, ``metadata["env"]``)."""
    by_env: dict[str, list[Group]] = {}
    for group in groups:
        name = env_name(group.task)
        if name is not None:
            by_env.setdefault(name, []).append(group)
    metrics: dict[str, float] = {}
    for name, env_groups in sorted(by_env.items()):
        metrics |= episode_metrics(env_groups, f"{prefix}{name}/", reward_of)
        metrics[f"{prefix}{name}/groups"] = float(len(env_groups))
    return metrics


def _env_metric_values(episodes: Sequence[Episode]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for key, value in episode.metrics.items():
            values.setdefault(key, []).append(float(value))
    return values
