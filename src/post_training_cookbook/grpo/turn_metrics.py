"""Numbers per turn index (``rollout/turn_<k>/…``, k counted from 0): what each turn of the
step's episodes earned, so that credit for an early turn shows as it is learned.

- ``episodes``: episodes that played a turn k;
- ``reward_mean``: their mean step reward at turn k (``Episode.rewards_by_turn``; with an
  env that rewards only its last step, the reward of the episodes that ended there);
- with ``turn_rewards="per_step"``, ``return_mean`` (the discounted return from turn k, the
  overlong penalty included) and ``informative_share``: the share of groups whose returns at
  turn k differ, the groups whose turn k is trained on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from post_training_cookbook.grpo.advantages import (
    AdvantageSettings,
    returns_by_turn_index,
    turn_returns,
)
from post_training_cookbook.rollout import Group, has_reward_variance


def per_turn_metrics(
    groups: Sequence[Group], settings: AdvantageSettings, prefix: str = "rollout/"
) -> dict[str, float]:
    episodes = [episode for group in groups for episode in group.episodes]
    rewards = returns_by_turn_index([episode.rewards_by_turn() for episode in episodes])
    metrics: dict[str, float] = {}
    for turn, at_turn in enumerate(rewards):
        metrics[f"{prefix}turn_{turn}/episodes"] = float(len(at_turn))
        metrics[f"{prefix}turn_{turn}/reward_mean"] = statistics.fmean(at_turn)
    if settings.turn_rewards != "per_step":
        return metrics
    shaping, discount = settings.shaping, settings.turn_discount
    returns_of_groups = [
        returns_by_turn_index([turn_returns(e, shaping, discount) for e in group.episodes])
        for group in groups
    ]
    for turn in range(len(rewards)):
        groups_at_turn = [by_turn[turn] for by_turn in returns_of_groups if len(by_turn) > turn]
        flat = [value for returns in groups_at_turn for value in returns]
        metrics[f"{prefix}turn_{turn}/return_mean"] = statistics.fmean(flat)
        varied = sum(has_reward_variance(returns) for returns in groups_at_turn)
        metrics[f"{prefix}turn_{turn}/informative_share"] = varied / max(1, len(groups))
    return metrics
