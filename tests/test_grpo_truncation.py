"""How truncated episodes are scored and trained ("Handle truncated episodes" in the hosted guide).

The first tests score hand-made episodes with ``grpo.advantages`` (numbers checkable by
hand); the last ones run each truncation cause through ``train_multi_turn`` with a scripted
policy and check the rewards, the advantages the trainer got, masking and the metrics.
"""

from __future__ import annotations

import math
import statistics

import pytest
from test_grpo_common import (
    ENV_REWARD,
    Closes,
    RecordedSamples,
    ScriptedPolicy,
    episode_mode,
    mode_envs,
    mode_tasks,
    quick_config,
    sample_advantage,
    step_metrics,
    train_dump,
)

from post_training_cookbook.envs import Task
from post_training_cookbook.grpo.advantages import AdvantageSettings, build_training_batch
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.lockstep import rollout_metrics
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.rollout import Episode, Group, TruncationCause, episode_metrics

TASK = Task(prompt="q", target="1")
# The penalty ramps from 0 at 80 tokens to -1 at 100: penalty(n) = -(n - 80) / 20.
SCORING_CONFIG = GRPOConfig(
    max_model_length=100,
    max_tokens_per_turn=50,
    overlong_buffer_length=20,
    overlong_penalty_factor=1.0,
    advantage_normalization="mean",
    wandb_project=None,
)


def advantage_settings(config: GRPOConfig) -> AdvantageSettings:
    """The advantage settings a run of ``config`` hands the GRPO math."""
    return RunSettings.from_config(config, resolve_model(BUNDLED_MODEL_ID)).steps.advantages


SCORING = advantage_settings(SCORING_CONFIG)


def episode(num_tokens: int, reward: float, cause: TruncationCause | None) -> Episode:
    """An episode of ``num_tokens`` tokens whose second half was sampled."""
    forced = num_tokens // 2
    mask = [0.0] * forced + [1.0] * (num_tokens - forced)
    return Episode(
        TASK,
        tokens=list(range(num_tokens)),
        mask=mask,
        sampler_logprobs=[-m for m in mask],
        versions=[0] * num_tokens,
        reward=reward,
        truncation=cause,
    )


@pytest.mark.parametrize(
    ("num_tokens", "reward", "cause", "shaped"),
    [
        (100, 0.0, TruncationCause.CONTEXT_OVERFLOW, -1.0),  # full: the whole penalty
        (90, 1.0, TruncationCause.MAX_TURNS, 0.5),  # half-way up the ramp: -0.5
        (60, 1.0, TruncationCause.MAX_TURNS, 1.0),  # far from the limit: no penalty
        (90, 0.25, TruncationCause.ENV, 0.25),  # never penalised
        (90, -0.3, TruncationCause.PARSE_FAILURE, -0.3),  # never penalised
        (90, 1.0, None, 1.0),  # terminated: never penalised
    ],
)
def test_only_context_overflow_and_max_turns_get_the_soft_overlong_penalty(
    num_tokens, reward, cause, shaped
):
    assert SCORING.shaping.shaped_reward(episode(num_tokens, reward, cause)) == pytest.approx(
        shaped
    )


def mixed_group() -> Group:
    """Shaped rewards 1, 0.5, 0.25, 0 (mean 0.4375): one of each ending."""
    return Group(
        TASK,
        [
            episode(10, 1.0, None),
            episode(90, 1.0, TruncationCause.MAX_TURNS),
            episode(90, 0.25, TruncationCause.ENV),
            episode(90, 0.0, TruncationCause.PARSE_FAILURE),
        ],
    )


def test_advantages_are_shaped_rewards_minus_the_group_mean_on_sampled_tokens_only():
    batch = build_training_batch([mixed_group()], SCORING)
    advantages = [sample_advantage(sample) for sample in batch.samples]
    assert advantages == pytest.approx([0.5625, 0.0625, -0.1875, -0.4375])
    for sample in batch.samples:
        assert all(a == 0.0 for a, m in zip(sample.advantages, sample.mask, strict=True) if not m)


def test_mean_std_normalization_divides_by_the_groups_std():
    config = GRPOConfig(**{**SCORING_CONFIG.to_dict(), "advantage_normalization": "mean_std"})
    batch = build_training_batch([mixed_group()], advantage_settings(config))
    std = math.sqrt((0.5625**2 + 0.0625**2 + 0.1875**2 + 0.4375**2) / 4)
    assert sample_advantage(batch.samples[0]) == pytest.approx(0.5625 / std)


def test_overlong_masking_drops_truncated_episodes_but_keeps_their_rewards_in_the_baseline():
    config = GRPOConfig(**{**SCORING_CONFIG.to_dict(), "overlong_masking": True})
    batch = build_training_batch([mixed_group()], advantage_settings(config))
    assert len(batch.samples) == 1 and batch.masked_episodes == 3
    # 1 - 0.4375: the truncated episodes' rewards are still in the mean
    assert sample_advantage(batch.samples[0]) == pytest.approx(0.5625)
    assert batch.metrics()["train/overlong_masked_episodes"] == 3.0


def test_a_group_whose_shaped_rewards_are_equal_gives_no_samples_and_is_counted():
    flat = Group(TASK, [episode(10, 0.5, None), episode(90, 0.5, TruncationCause.ENV)])
    batch = build_training_batch([flat, mixed_group()], SCORING)
    assert batch.zero_variance_groups == 1 and batch.num_groups == 1
    assert len(batch.samples) == 4


def test_the_overlong_penalty_alone_makes_a_group_informative():
    # raw rewards are equal; the MAX_TURNS episode's penalty (-0.5) separates them
    group = Group(TASK, [episode(10, 0.0, None), episode(90, 0.0, TruncationCause.MAX_TURNS)])
    batch = build_training_batch([group], SCORING)
    assert [sample_advantage(s) for s in batch.samples] == pytest.approx([0.25, -0.25])


def test_reward_variance_is_judged_on_shaped_rewards_by_the_skip_and_the_metric_alike():
    # raw rewards are equal (no raw variance), shaped rewards differ: the group is trained,
    # and the step's reward_variance_share counts it, as the skip does
    informative = Group(TASK, [episode(10, 0.0, None), episode(90, 0.0, TruncationCause.MAX_TURNS)])
    flat = Group(TASK, [episode(10, 0.0, None), episode(90, 0.0, TruncationCause.ENV)])
    batch = build_training_batch([informative, flat], SCORING)
    metrics = rollout_metrics([informative, flat], SCORING)
    assert (batch.num_groups, batch.zero_variance_groups) == (1, 1)
    assert metrics["rollout/reward_variance_share"] == 0.5
    # on raw rewards neither group varies: the metric would have disagreed with the skip
    assert episode_metrics([informative, flat])["rollout/reward_variance_share"] == 0.0


# ---------------------------------------------------------------- through the loop

# One group, one episode per ending. Prompts are ~170 tokens, so with max_model_length=300
# the rambling turn is cut by the context budget (130 < max_tokens_per_turn=200) and the
# looping episode reaches max_turns=2 at ~236 tokens. The penalty ramps over 150..300
# tokens, penalty(n) = -(n - 150) / 150, so every episode here is long enough to be
# penalised if its cause were.
MODES = ("answer", "wrong", "loop", "env", "parse", "ramble")
CAUSES = {
    "answer": None,
    "wrong": None,
    "loop": "max_turns",
    "env": "env",
    "parse": "parse_failure",
    "ramble": "context_overflow",
}
RAW_REWARDS = {"answer": 1.0, "wrong": 0.0, "loop": 0.0, "env": ENV_REWARD, "parse": -0.25}


def run_every_ending(tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch, **overrides):
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)
    recorded = RecordedSamples(monkeypatch)
    closes = Closes()
    config = quick_config(
        tiny_llama_dir,
        tmp_path,
        episodes_per_task=len(MODES),
        max_turns=2,
        max_model_length=300,
        max_tokens_per_turn=200,
        overlong_buffer_length=150,
        overlong_penalty_factor=1.0,
        failed_parse_reward=-0.25,
        **overrides,
    )
    run = train_multi_turn(config, mode_tasks(MODES), mode_envs(closes))
    records = {episode_mode(record): record for record in train_dump(run.path, 0)}
    return run, records, recorded, closes


@pytest.mark.parametrize("overlong_masking", [False, True])
def test_each_truncation_cause_is_scored_masked_and_counted_as_the_docs_say(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch, overlong_masking
):
    run, records, recorded, closes = run_every_ending(
        tiny_llama_dir,
        tiny_llama_tokenizer,
        tmp_path,
        monkeypatch,
        overlong_masking=overlong_masking,
    )
    assert sorted(records) == sorted(MODES)
    assert {mode: r["truncation"] for mode, r in records.items()} == CAUSES
    assert records["ramble"]["num_tokens"] == 300  # filled max_model_length
    assert records["loop"]["num_turns"] == 2
    assert all(r["num_tokens"] > 160 for r in records.values())  # all inside the ramp
    # the episode's reward is the env's (the parse failure's is failed_parse_reward)
    assert {mode: records[mode]["reward"] for mode in RAW_REWARDS} == RAW_REWARDS

    def penalty(mode: str) -> float:
        return -(records[mode]["num_tokens"] - 150) / 150

    shaped = {mode: RAW_REWARDS.get(mode, 0.0) for mode in MODES}
    shaped["loop"] += penalty("loop")
    shaped["ramble"] += penalty("ramble")
    assert shaped["ramble"] == -1.0 and -1.0 < shaped["loop"] < -0.4
    mean, std = statistics.fmean(shaped.values()), statistics.pstdev(shaped.values())
    expected = {mode: (value - mean) / std for mode, value in shaped.items()}

    (samples,) = recorded.batches
    trained = {}
    for sample in samples:
        (mode,) = [m for m, r in records.items() if r["token_ids"] == sample.tokens]
        assert sample.mask == [float(bit) for bit in records[mode]["mask"]]
        trained[mode] = sample_advantage(sample)
    kept = ("answer", "wrong") if overlong_masking else MODES
    assert sorted(trained) == sorted(kept)
    assert trained == pytest.approx({mode: expected[mode] for mode in kept})

    metrics = step_metrics(run.path)[0]
    sixth = 1 / 6
    assert metrics["rollout/terminated_ratio"] == pytest.approx(2 * sixth)
    assert metrics["rollout/truncated_ratio"] == pytest.approx(4 * sixth)
    for key in ("context_overflow", "max_turns", "env_truncated", "parse_failure"):
        assert metrics[f"rollout/{key}_ratio"] == pytest.approx(sixth), key
    assert metrics["train/samples"] == len(kept)
    assert metrics["train/overlong_masked_episodes"] == (4 if overlong_masking else 0)
    assert metrics["policy/version"] == 1.0
    assert closes.built == closes.closed == len(MODES)
