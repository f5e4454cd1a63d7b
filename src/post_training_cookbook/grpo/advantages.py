"""The GRPO math, as pure functions over small frozen settings: shaped rewards, which groups
are informative, group-relative advantages, and the training samples the trainer gets.

- Reward shaping: DAPO's soft overlong penalty (computed on the episode's total tokens) is
  added only to episodes the loop truncated for ``CONTEXT_OVERFLOW`` or ``MAX_TURNS``.
- A group is informative when its shaped rewards differ (``rollout.has_reward_variance``):
  only then are its advantages not all zero. Other groups are skipped and counted, not
  trained on with zero advantages; ``reward_variance_share`` uses the same rule.
- Advantage = shaped reward − group mean, divided by the group's std under
  ``normalization="mean_std"``: ``group_advantages``, step 1 of the objective, which reads
  on to the loss in ``trainer/objective.py``.
- ``overlong_masking``: truncated episodes of any cause give no sample, but their rewards
  stay in the group baseline.
- Every sampled token of an episode gets the episode's advantage; forced tokens get 0.
- ``turn_rewards="per_step"`` instead gives every turn its own
  advantage: returns of the per-step rewards, discounted by ``turn_discount``, compared
  with the group's episodes at the same turn index; each token gets its turn's.
- An episode is one sample, except an external agent's whose history broke between calls
  (``agents/``): each of its segments is a sample of its own, with the episode's advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from post_training_cookbook.models.moe_routing import RoutedExperts
from post_training_cookbook.rollout import Episode, Group, TruncationCause, has_reward_variance
from post_training_cookbook.trainer.objective import group_advantages
from post_training_cookbook.trainer.types import (
    AdvantageNormalization,
    TrainingSample,
    TurnRewards,
)

PENALISED_CAUSES = (TruncationCause.CONTEXT_OVERFLOW, TruncationCause.MAX_TURNS)


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
    turn_rewards: TurnRewards = "final"
    """``"final"``: one advantage per episode, from its last step's reward (the hosted
    guide's rule); ``"per_step"``: one per turn, from every step's reward."""
    turn_discount: float = 1.0
    """γ of the per-step returns: G_k = r_k + γ · G_{k+1}."""
    env_advantage: bool = True
    """False (distillation alone, ``distill_env_advantage=False``): every group is trained,
    reward variance or not, and the env gives no advantage (the teacher's is added later)."""


def is_informative(group: Group, settings: AdvantageSettings) -> bool:
    """Whether training on ``group`` can move the policy: its advantages are not all 0."""
    if not settings.env_advantage:  # the teacher's advantages move it
        return any(episode.num_sampled_tokens for episode in group.episodes)
    if settings.turn_rewards == "per_step":
        return any(has_reward_variance(at_turn) for at_turn in returns_by_turn_index(
            [turn_returns(e, settings.shaping, settings.turn_discount) for e in group.episodes]
        ))  # fmt: skip
    shaping = settings.shaping
    return has_reward_variance([shaping.shaped_reward(episode) for episode in group.episodes])


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
        if not is_informative(group, settings):
            zero_variance += 1
            continue
        trained_groups += 1
        for episode, token_advantages in zip(
            group.episodes, _token_advantages(group, settings), strict=True
        ):
            if settings.overlong_masking and not episode.terminated:
                masked += 1
                continue
            samples += episode_samples(episode, token_advantages)
    return TrainingBatch(samples, trained_groups, zero_variance, masked)


def _token_advantages(group: Group, settings: AdvantageSettings) -> list[list[float]]:
    """Each episode's advantage of each of its tokens (0 on forced tokens)."""
    if not settings.env_advantage:
        return [[0.0] * len(episode.tokens) for episode in group.episodes]
    if settings.turn_rewards == "per_step":
        return turn_token_advantages(group, settings.shaping, settings.turn_discount,
                                     settings.normalization)  # fmt: skip
    rewards = [settings.shaping.shaped_reward(episode) for episode in group.episodes]
    advantages = group_advantages(rewards, settings.normalization)
    return [
        [advantage * m for m in episode.mask]
        for episode, advantage in zip(group.episodes, advantages, strict=True)
    ]


def episode_samples(episode: Episode, token_advantages: list[float]) -> list[TrainingSample]:
    """One sample per token sequence of the episode that sampled anything, with each token's
    advantage (``token_advantages`` runs over the whole episode)."""
    return [
        TrainingSample(
            tokens=episode.tokens[piece],
            mask=episode.mask[piece],
            sampler_logprobs=episode.sampler_logprobs[piece],
            advantages=token_advantages[piece],
            routed_experts=_piece_of(episode.routed_experts, piece),
        )
        for piece in episode.segments()
        if any(episode.mask[piece])
    ]


def _piece_of(routes: RoutedExperts | None, piece: slice) -> RoutedExperts | None:
    return None if routes is None else routes[piece]


# ---------------------------------------------------------------- per-step rewards


def turn_returns(episode: Episode, shaping: RewardShaping, discount: float) -> list[float]:
    """The return of each of the episode's turns, G_k = r_k + γ · G_{k+1}, over its per-step
    rewards; the overlong penalty joins the last turn's reward, as it joins the episode's."""
    rewards = episode.rewards_by_turn()
    if rewards and episode.truncation in PENALISED_CAUSES:
        rewards[-1] += shaping.overlong_penalty(episode.context_tokens)
    returns: list[float] = []
    running = 0.0
    for reward in reversed(rewards):
        running = reward + discount * running
        returns.append(running)
    return returns[::-1]


def returns_by_turn_index(returns: Sequence[Sequence[float]]) -> list[list[float]]:
    """The returns of turn k of every episode that played a turn k, for each k."""
    depth = max((len(episode_returns) for episode_returns in returns), default=0)
    return [[r[turn] for r in returns if len(r) > turn] for turn in range(depth)]


def per_turn_advantages(
    returns: Sequence[Sequence[float]], normalization: AdvantageNormalization
) -> list[list[float]]:
    """Each episode's advantage of each turn: its return compared with the returns of the
    group's episodes at the same turn index (docs/losses.md, Turn-level rewards). A turn
    index whose returns do not vary (one episode alone got that far, say) gives 0."""
    advantages = [[0.0] * len(episode_returns) for episode_returns in returns]
    for turn, at_turn in enumerate(returns_by_turn_index(returns)):
        if not has_reward_variance(at_turn):
            continue
        values = iter(group_advantages(at_turn, normalization))
        for episode_returns, episode_advantages in zip(returns, advantages, strict=True):
            if len(episode_returns) > turn:
                episode_advantages[turn] = next(values)
    return advantages


def turn_token_advantages(
    group: Group,
    shaping: RewardShaping,
    discount: float,
    normalization: AdvantageNormalization,
) -> list[list[float]]:
    """Each episode's per-token advantages: a sampled token gets its turn's advantage."""
    returns = [turn_returns(episode, shaping, discount) for episode in group.episodes]
    by_episode = per_turn_advantages(returns, normalization)
    token_advantages = []
    for episode, advantages in zip(group.episodes, by_episode, strict=True):
        if len(episode.token_turns) != len(episode.tokens):
            raise ValueError(
                f"an episode of task {episode.task.prompt[:80]!r} does not say which turn "
                "sampled each token (Episode.token_turns): turn_rewards='per_step' needs "
                "episodes played by the rollout layer or an AgentEnvs agent"
            )
        token_advantages.append(
            [
                advantages[turn] * m if turn >= 0 else 0.0
                for turn, m in zip(episode.token_turns, episode.mask, strict=True)
            ]
        )
    return token_advantages
