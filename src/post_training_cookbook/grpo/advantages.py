"""The GRPO math, as pure functions over small frozen settings: shaped rewards, which groups
are informative, group-relative advantages, and the training samples the trainer gets.

- Reward shaping: DAPO's soft overlong penalty (computed on the episode's total tokens) is
  added only to episodes the loop truncated for ``CONTEXT_OVERFLOW`` or ``MAX_TURNS``.
- A group is informative when its shaped rewards differ (``rollout.has_reward_variance``):
  only then are its advantages not all zero. Other groups are skipped and counted, not
  trained on with zero advantages; ``reward_variance_share`` uses the same rule.
- Advantage = shaped reward − group mean, divided by the group's std under
  ``normalization="mean_std"``.
- ``overlong_masking``: truncated episodes of any cause give no sample, but their rewards
  stay in the group baseline.
- Every sampled token of an episode gets the episode's advantage; forced tokens get 0.
- An episode is one sample, except an external agent's whose history broke between calls
  (``agents/``): each of its segments is a sample of its own, with the episode's advantage.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from post_training_cookbook.rollout import Episode, Group, TruncationCause, has_reward_variance
from post_training_cookbook.trainer.types import TrainingSample

AdvantageNormalization = Literal["mean", "mean_std"]
PENALISED_CAUSES = (TruncationCause.CONTEXT_OVERFLOW, TruncationCause.MAX_TURNS)
_STD_FLOOR = 1e-6


@dataclass(frozen=True)
class RewardShaping:
    """DAPO's soft overlong penalty: 0 up to ``max_model_length - buffer_length`` tokens,
    then falling linearly to ``-penalty_factor`` at ``max_model_length``."""

    max_model_length: int
    buffer_length: int = 0
    """0 turns the penalty off."""
    penalty_factor: float = 1.0

    def overlong_penalty(self, num_tokens: int) -> float:
        """The penalty (<= 0) for an episode of ``num_tokens`` tokens."""
        if self.buffer_length == 0:
            return 0.0
        start = self.max_model_length - self.buffer_length
        excess = min(max(num_tokens - start, 0), self.buffer_length)
        return -self.penalty_factor * excess / self.buffer_length

    def shaped_reward(self, episode: Episode) -> float:
        """The reward GRPO compares within a group: the env's, plus the overlong penalty for
        an episode the loop cut for context or turns."""
        if episode.truncation in PENALISED_CAUSES:
            return episode.reward + self.overlong_penalty(episode.context_tokens)
        return episode.reward


@dataclass(frozen=True)
class AdvantageSettings:
    shaping: RewardShaping
    normalization: AdvantageNormalization = "mean_std"
    overlong_masking: bool = False
    """Build no samples from truncated episodes (their rewards still count in the baseline)."""


def is_informative(group: Group, shaping: RewardShaping) -> bool:
    return has_reward_variance([shaping.shaped_reward(episode) for episode in group.episodes])


def group_advantages(
    rewards: Sequence[float], normalization: AdvantageNormalization
) -> list[float]:
    mean = statistics.fmean(rewards)
    centered = [reward - mean for reward in rewards]
    if normalization == "mean_std":
        std = max(statistics.pstdev(rewards), _STD_FLOOR)
        return [value / std for value in centered]
    return centered


@dataclass
class TrainingBatch:
    samples: list[TrainingSample]
    num_groups: int
    """Informative groups the samples come from."""
    zero_variance_groups: int
    masked_episodes: int
    """Truncated episodes left out by ``overlong_masking``."""

    def metrics(self) -> dict[str, float]:
        return {
            "train/samples": float(len(self.samples)),
            "train/groups": float(self.num_groups),
            "train/trained_tokens": float(sum(s.num_trained_tokens for s in self.samples)),
            "train/overlong_masked_episodes": float(self.masked_episodes),
        }


def build_training_batch(groups: Sequence[Group], settings: AdvantageSettings) -> TrainingBatch:
    """Samples of every informative group's episodes, each with its group-relative advantage."""
    samples: list[TrainingSample] = []
    zero_variance = masked = trained_groups = 0
    for group in groups:
        rewards = [settings.shaping.shaped_reward(episode) for episode in group.episodes]
        if not has_reward_variance(rewards):
            zero_variance += 1
            continue
        trained_groups += 1
        advantages = group_advantages(rewards, settings.normalization)
        for episode, advantage in zip(group.episodes, advantages, strict=True):
            if settings.overlong_masking and not episode.terminated:
                masked += 1
                continue
            samples += episode_samples(episode, advantage)
    return TrainingBatch(samples, trained_groups, zero_variance, masked)


def episode_samples(episode: Episode, advantage: float) -> list[TrainingSample]:
    """One sample per token sequence of the episode that sampled anything."""
    return [
        TrainingSample(
            tokens=episode.tokens[piece],
            mask=episode.mask[piece],
            sampler_logprobs=episode.sampler_logprobs[piece],
            advantages=[advantage * m for m in episode.mask[piece]],
        )
        for piece in episode.segments()
        if any(episode.mask[piece])
    ]
