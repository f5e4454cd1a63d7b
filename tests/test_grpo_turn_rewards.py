"""Turn-level rewards (``turn_rewards="per_step"``): per-turn returns and advantages checked
by hand, ``"final"`` unchanged to the bit, and the turn metrics a run logs.

The episodes here are built by hand with ``Episode.add_forced`` / ``add_sampled``, the way
the rollout builds them, so each token knows its turn (``token_turns``).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_trainer import make_trainer

from post_training_cookbook.engine.types import PolicySegment, SampledSequence
from post_training_cookbook.envs import Task
from post_training_cookbook.grpo.advantages import (
    AdvantageSettings,
    RewardShaping,
    build_training_batch,
    group_advantages,
    is_informative,
    turn_returns,
)
from post_training_cookbook.grpo.turn_metrics import per_turn_metrics
from post_training_cookbook.rollout import Episode, Group, TruncationCause
from post_training_cookbook.trainer.types import LossConfig, TrainingSample

TASK = Task(prompt="q", target="1")
NO_PENALTY = RewardShaping(max_model_length=1000)


def played(turn_rewards: list[float], *, tokens_per_turn: int = 2, start: int = 10) -> Episode:
    """An episode of ``len(turn_rewards)`` turns: a 3-token prompt, then per turn
    ``tokens_per_turn`` sampled tokens and one forced tool-result token."""
    episode = Episode(TASK, [], [], [], [])
    episode.add_forced([1, 2, 3])
    token = start
    for reward in turn_rewards:
        sampled = list(range(token, token + tokens_per_turn))
        token += tokens_per_turn
        logprobs = [-0.5] * tokens_per_turn
        episode.add_sampled(SampledSequence(sampled, logprobs, "stop", [PolicySegment(0, 0)]))
        episode.num_turns += 1
        episode.turn_rewards.append(reward)
        episode.reward = reward
        episode.add_forced([4])
    return episode


def per_step(discount: float, normalization: str = "mean") -> AdvantageSettings:
    return AdvantageSettings(
        NO_PENALTY, normalization, turn_rewards="per_step", turn_discount=discount
    )  # type: ignore[arg-type]


def sampled_advantages(sample: TrainingSample) -> list[float]:
    return [a for a, m in zip(sample.advantages, sample.mask, strict=True) if m]


def test_per_step_advantages_equal_a_hand_computation_on_a_three_turn_group() -> None:
    # rewards per turn, γ = 0.5; C ends after two turns
    a, b, c = played([1, 0, 1]), played([0, 0, 1]), played([1, 0])
    # returns, by hand: A 1.25, 0.5, 1   B 0.25, 0.5, 1   C 1, 0
    assert turn_returns(a, NO_PENALTY, 0.5) == [1.25, 0.5, 1.0]
    assert turn_returns(b, NO_PENALTY, 0.5) == [0.25, 0.5, 1.0]
    assert turn_returns(c, NO_PENALTY, 0.5) == [1.0, 0.0]
    # turn 0: mean 5/6 → 5/12, -7/12, 2/12; turn 1: mean 1/3 → 1/6, 1/6, -1/3;
    # turn 2: A and B both return 1: no variance, advantage 0
    expected = {
        "mean": [[5 / 12, 1 / 6, 0.0], [-7 / 12, 1 / 6, 0.0], [2 / 12, -1 / 3]],
        "mean_std": [  # divided by each turn's population std
            [5 / 12 / math.sqrt(78 / 432), 1 / 6 / math.sqrt(2 / 36), 0.0],
            [-7 / 12 / math.sqrt(78 / 432), 1 / 6 / math.sqrt(2 / 36), 0.0],
            [2 / 12 / math.sqrt(78 / 432), -1 / 3 / math.sqrt(2 / 36)],
        ],
    }
    for normalization, by_turn in expected.items():
        batch = build_training_batch([Group(TASK, [a, b, c])], per_step(0.5, normalization))
        assert batch.num_groups == 1 and len(batch.samples) == 3
        for sample, turn_advantages in zip(batch.samples, by_turn, strict=True):
            # every sampled token gets its turn's advantage (2 tokens a turn), forced ones 0
            wanted = [value for value in turn_advantages for _ in range(2)]
            assert sampled_advantages(sample) == pytest.approx(wanted, abs=1e-12)
            forced = [x for x, m in zip(sample.advantages, sample.mask, strict=True) if not m]
            assert forced == [0.0] * len(forced)


def test_a_discount_of_zero_credits_each_turn_with_its_own_step_alone() -> None:
    episode = played([0.2, 0.0, 1.0])
    assert turn_returns(episode, NO_PENALTY, 0.0) == [0.2, 0.0, 1.0]
    assert turn_returns(episode, NO_PENALTY, 1.0) == pytest.approx([1.2, 1.0, 1.0])


def test_the_overlong_penalty_joins_the_last_turns_reward() -> None:
    shaping = RewardShaping(max_model_length=20, buffer_length=10, penalty_factor=1.0)
    episode = played([1.0, 0.0, 0.0])  # 3 + 3 * 3 = 12 tokens: 2 into the 10-token ramp
    episode.truncation = TruncationCause.MAX_TURNS
    assert shaping.shaped_reward(episode) == pytest.approx(-0.2)
    assert turn_returns(episode, shaping, 1.0) == pytest.approx([0.8, -0.2, -0.2])
    episode.truncation = None  # a terminated episode is not penalised
    assert turn_returns(episode, shaping, 1.0) == pytest.approx([1.0, 0.0, 0.0])


def test_turns_no_step_answered_count_zero_and_tool_results_stay_untrained() -> None:
    episode = played([1.0, 0.0])
    episode.add_sampled(SampledSequence([90, 91], [-1.0, -1.0], "length", []))
    episode.num_turns += 1  # a third turn cut for context: no step answered it
    assert episode.rewards_by_turn() == [1.0, 0.0, 0.0]
    assert episode.token_turns == [-1, -1, -1, 0, 0, -1, 1, 1, -1, 2, 2]


def test_dynamic_sampling_sees_the_variance_of_intermediate_rewards() -> None:
    # same final reward, different first-turn rewards: nothing to learn under "final"
    group = Group(TASK, [played([1.0, 1.0]), played([0.0, 1.0])])
    assert not is_informative(group, AdvantageSettings(NO_PENALTY))
    assert is_informative(group, per_step(1.0))
    batch = build_training_batch([group], per_step(0.0))
    first, second = (sampled_advantages(s) for s in batch.samples)
    assert first == [0.5, 0.5, 0.0, 0.0] and second == [-0.5, -0.5, 0.0, 0.0]
    assert build_training_batch([group], AdvantageSettings(NO_PENALTY)).samples == []


def test_an_episode_that_does_not_say_its_tokens_turns_is_refused_under_per_step() -> None:
    bare = Episode(TASK, [1, 2, 3], [0.0, 1.0, 1.0], [0.0, -1.0, -1.0], [-1, 0, 0])
    bare.num_turns, bare.turn_rewards = 1, [1.0]
    group = Group(TASK, [bare, played([0.0])])
    with pytest.raises(ValueError, match="token_turns"):
        build_training_batch([group], per_step(1.0))


def _previous_rule(group: Group, settings: AdvantageSettings) -> list[TrainingSample]:
    """The samples as the code before turn rewards built them: one advantage per episode
    from its shaped last-step reward, times the mask."""
    rewards = [settings.shaping.shaped_reward(e) for e in group.episodes]
    return [
        TrainingSample(e.tokens, e.mask, e.sampler_logprobs, [adv * m for m in e.mask])
        for e, adv in zip(group.episodes, group_advantages(rewards, "mean_std"), strict=True)
    ]


def _loss_and_grads(samples: list[TrainingSample]) -> tuple[float, list[torch.Tensor]]:
    trainer = make_trainer(use_lora=False)
    result = trainer.forward_backward(samples, LossConfig(loss_type="grpo"))
    grads = [p.grad.clone() for p in trainer.trainable_parameters().values() if p.grad is not None]
    return result.loss, grads


def test_final_turn_rewards_give_bit_identical_losses_to_the_previous_rule() -> None:
    shaping = RewardShaping(max_model_length=14, buffer_length=6, penalty_factor=0.5)
    episodes = [played([0.0, 1.0]), played([0.3, 0.0, 0.0]), played([1.0, 0.0, 0.7])]
    episodes[1].truncation = TruncationCause.MAX_TURNS  # penalised: 12 tokens of 14
    group = Group(TASK, episodes)
    settings = AdvantageSettings(shaping)  # turn_rewards="final", the default
    built = build_training_batch([group], settings).samples
    previous = _previous_rule(group, settings)
    assert built == previous  # the same samples, advantages to the bit
    loss, grads = _loss_and_grads(built)
    previous_loss, previous_grads = _loss_and_grads(previous)
    assert grads and loss != 0.0 and loss == previous_loss
    assert all(torch.equal(g, h) for g, h in zip(grads, previous_grads, strict=True))


def test_per_step_with_only_final_rewards_and_equal_lengths_is_the_final_rule() -> None:
    group = Group(TASK, [played([0.0, 0.0, r]) for r in (1.0, 0.0, 0.5)])
    final = build_training_batch([group], AdvantageSettings(NO_PENALTY)).samples
    stepwise = build_training_batch([group], per_step(1.0, "mean_std")).samples
    assert [sampled_advantages(s) for s in stepwise] == [sampled_advantages(s) for s in final]


def test_per_turn_metrics_report_each_turn_index() -> None:
    groups = [Group(TASK, [played([1.0, 0.0]), played([0.0, 0.0, 1.0])])]
    final = per_turn_metrics(groups, AdvantageSettings(NO_PENALTY))
    assert final == {
        "rollout/turn_0/episodes": 2.0,
        "rollout/turn_0/reward_mean": 0.5,
        "rollout/turn_1/episodes": 2.0,
        "rollout/turn_1/reward_mean": 0.0,
        "rollout/turn_2/episodes": 1.0,
        "rollout/turn_2/reward_mean": 1.0,
    }
    stepwise = per_turn_metrics(groups, per_step(1.0))
    assert stepwise["rollout/turn_0/return_mean"] == 1.0  # returns 1 and 1
    assert stepwise["rollout/turn_0/informative_share"] == 0.0
    assert stepwise["rollout/turn_1/return_mean"] == 0.5  # returns 0 and 1
    assert stepwise["rollout/turn_1/informative_share"] == 1.0
    assert stepwise["rollout/turn_2/informative_share"] == 0.0  # one episode got that far
