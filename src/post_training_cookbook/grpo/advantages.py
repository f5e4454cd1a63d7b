"""From groups of episodes to training samples: shaped rewards, group-relative advantages,
and the samples the trainer gets.

- Reward shaping: DAPO's soft overlong penalty (``GRPOConfig.overlong_penalty``, computed on
  the episode's total tokens) is added only to episodes the loop truncated for
  ``CONTEXT_OVERFLOW`` or ``MAX_TURNS``.
- Advantage = shaped reward − group mean, divided by the group's std under
  ``advantage_normalization="mean_std"``. Groups whose rewards are all equal carry no
  gradient: they are skipped (and counted) rather than trained on with zero advantages.
- ``overlong_masking``: truncated episodes of any cause give no sample, but their rewards
  stay in the group baseline.
- Every sampled token of an episode gets the episode's advantage; forced tokens get 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from post_training_cookbook.groups import Group
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.rollout import Episode, TruncationCause
from post_training_cookbook.service.types import TrainingSample

PENALISED_CAUSES = (TruncationCause.CONTEXT_OVERFLOW, TruncationCause.MAX_TURNS)
_STD_FLOOR = 1e-6


def shaped_reward(episode: Episode, config: GRPOConfig) -> float:
    if episode.truncation in PENALISED_CAUSES:
        return episode.reward + config.overlong_penalty(len(episode.tokens))
    return episode.reward


def group_advantages(rewards: Sequence[float], normalization: str) -> list[float]:
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


def build_training_batch(groups: Sequence[Group], config: GRPOConfig) -> TrainingBatch:
    samples: list[TrainingSample] = []
    zero_variance = masked = trained_groups = 0
    for group in groups:
        rewards = [shaped_reward(episode, config) for episode in group.episodes]
        if max(rewards) - min(rewards) <= 0.0:
            zero_variance += 1
            continue
        trained_groups += 1
        advantages = group_advantages(rewards, config.advantage_normalization)
        for episode, advantage in zip(group.episodes, advantages, strict=True):
            if config.overlong_masking and not episode.terminated:
                masked += 1
                continue
            if any(episode.mask):
                samples.append(episode_sample(episode, advantage))
    return TrainingBatch(samples, trained_groups, zero_variance, masked)


def episode_sample(episode: Episode, advantage: float) -> TrainingSample:
    return TrainingSample(
        tokens=list(episode.tokens),
        mask=list(episode.mask),
        sampler_logprobs=list(episode.sampler_logprobs),
        advantages=[advantage * m for m in episode.mask],
    )
