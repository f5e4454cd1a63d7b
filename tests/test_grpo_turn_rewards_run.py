"""Turn-level rewards in a run of the bundled model: an env that rewards a correct first tool
call, and nothing after it, trains that call's tokens under ``turn_rewards="per_step"``
(shown in the per-turn metrics and the trained model's log-probabilities) and nothing at all
under ``"final"``, whose last-step rewards are all 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_grpo_common import RecordedSamples, step_metrics, train_dump

from post_training_cookbook.envs import StepResult
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_DIR
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import TrainerSettings, TrainingSample
from post_training_cookbook.types import Message

TASKS = [task for task in TOOL_USE_GAME_TASKS if task.metadata["level"] == 3][:40]


class FirstCallEnv(ToolUseGameEnv):
    """The tool-use game, rewarded on its first step alone: 1.0 when the first assistant
    message looks up the task's first fact (``lookup`` of ``metadata["keys"][0]``), else 0;
    every later step (the graded answer included) gives 0."""

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        reward = float(self.num_turns == 1 and _looks_up(message, self.task.metadata["keys"][0]))
        return StepResult(
            result.terminated, result.truncated, result.messages, reward, result.metrics
        )


def _looks_up(message: Message, key: str) -> bool:
    calls = message.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "lookup":
        return False
    arguments = calls[0]["function"]["arguments"]
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    return isinstance(parsed, dict) and parsed.get("key") == key


def run(runs_dir: Path, turn_rewards: str, **overrides: Any) -> Path:
    settings: dict[str, Any] = dict(
        batch_size=2,
        episodes_per_task=6,
        num_steps=3,
        max_turns=2,
        max_model_length=768,
        max_tokens_per_turn=48,
        learning_rate=2e-3,
        turn_rewards=turn_rewards,  # type: ignore[arg-type]
        wandb_project=None,
        validation_interval=0,
        checkpoint_interval=0,
        runs_dir=str(runs_dir),
        run_name=f"{turn_rewards}-{overrides.get('max_steps_off_policy')}",
        seed=1,
    )
    config = GRPOConfig(**(settings | overrides))
    return train_multi_turn(config, tasks=TASKS, env_factory=lambda task: FirstCallEnv()).path


def turn_zero_objective(model: Path, samples: list[TrainingSample]) -> float:
    """Σ advantage · log π over the samples' trained tokens, under ``model``'s weights."""
    trainer = Trainer(model, TrainerSettings(use_lora=False, autocast_bf16=False, device="cpu"))
    try:
        logprobs = trainer.forward(samples)
    finally:
        trainer.close()
    return sum(
        a * lp
        for sample, row in zip(samples, logprobs, strict=True)
        for a, lp, m in zip(sample.advantages, row, sample.mask, strict=True)
        if m
    )


def test_a_rewarded_first_tool_call_trains_that_calls_tokens(
    tmp_path: Path, monkeypatch: Any
) -> None:
    recorded = RecordedSamples(monkeypatch)
    run_dir = run(tmp_path, "per_step")
    metrics = step_metrics(run_dir)
    assert set(metrics) == {0, 1, 2}
    for step in metrics.values():
        assert step["rollout/turn_1/informative_share"] == 0.0  # later turns earn nothing
        assert step["rollout/turn_1/reward_mean"] == 0.0
        assert 0.0 <= step["rollout/turn_0/reward_mean"] <= 1.0
    assert metrics[0]["rollout/turn_0/informative_share"] > 0.0
    # each step-0 episode's first-turn reward is its first call's, and only turn-0 tokens
    # of the batch trained on carry an advantage
    episodes = {tuple(record["token_ids"]): record for record in train_dump(run_dir, 0)}
    first_batch = recorded.batches[0]
    assert first_batch
    for sample in first_batch:
        record = episodes[tuple(sample.tokens)]
        turns = record["token_turns"]
        assert any(a != 0 for a in sample.advantages)
        assert all(a == 0 for a, turn in zip(sample.advantages, turns, strict=True) if turn != 0)
        reward = record["turn_rewards"][0]
        assert (reward == 1.0) == (sample.advantages[turns.index(0)] > 0)
    # the policy-gradient objective of that batch rose: rewarded first calls became likelier
    before = turn_zero_objective(BUNDLED_MODEL_DIR, first_batch)
    after = turn_zero_objective(run_dir / "final_model", first_batch)
    assert after > before


def test_final_rewards_see_nothing_to_learn_in_the_same_env(tmp_path: Path) -> None:
    metrics = step_metrics(run(tmp_path, "final"))
    for step in metrics.values():  # every last step gives 0: every group is skipped
        assert step["rollout/zero_variance_skip_ratio"] == 1.0
        assert step["train/samples"] == 0.0
    assert "rollout/turn_0/return_mean" not in metrics[0]  # returns are per_step's alone
    assert any(step["rollout/turn_0/reward_mean"] > 0 for step in metrics.values())


def test_the_async_loop_trains_on_per_step_rewards_too(tmp_path: Path, monkeypatch: Any) -> None:
    recorded = RecordedSamples(monkeypatch)
    metrics = step_metrics(run(tmp_path, "per_step", max_steps_off_policy=1, num_steps=2))
    assert set(metrics) == {0, 1}
    assert all(step["rollout/turn_1/informative_share"] == 0.0 for step in metrics.values())
    trained = [sample for batch in recorded.batches for sample in batch]
    assert trained and all(any(a != 0 for a in sample.advantages) for sample in trained)
    assert sum(step["train/samples"] for step in metrics.values()) == len(trained)
