"""The hosted guide's training example ("Run multi-turn training"), run as it is written.

Only ``model`` (the tiny random model), ``num_steps`` (2), ``wandb_project`` (None) and
``runs_dir`` (a temporary folder) differ from the page. The run writes everything SPEC §5
promises: config.yaml, metrics.jsonl, rollout dumps, a checkpoint and a final model.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import transformers
from test_grpo_common import read_jsonl, step_metrics

from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn


def run_hosted_guide_example(model, runs_dir, val_every):
    tasks = list(TOOL_USE_GAME_TASKS)

    config = GRPOConfig(
        model=str(model),  # changed: "Qwen/Qwen3.8-27B"
        batch_size=4,
        episodes_per_task=8,
        num_steps=2,  # changed: 200
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-5,
        wandb_project=None,  # changed: "grpo-tool-use-game"
        sequential_validation=True,
        max_sampling_attempts=2,
        runs_dir=str(runs_dir),  # added: keep the run out of ./runs
    )

    run = train_multi_turn(
        config,
        tasks=tasks,
        env_factory=lambda task: ToolUseGameEnv(),
        # The page validates on all 1300 tasks. With the random tiny model each validation
        # takes ~45 s on a shared CPU core, twice per run, so the default suite validates on
        # every 50th task; the heavy test below runs val_tasks=tasks as written.
        val_tasks=tasks[::val_every],
    )
    return config, run, tasks


def check_run_folder(config, run, tasks, num_val_tasks):
    assert run.path.parent == Path(config.runs_dir)
    assert run.path.name.startswith("grpo-")  # the loop named the run once

    # config.yaml: the run's config (with its resolved name), loadable as is
    saved = GRPOConfig.from_yaml(run.path / "config.yaml")
    assert saved == replace(config, run_name=run.path.name)

    # metrics.jsonl: one line per step, in order, plus the final validation's line
    lines = read_jsonl(run.metrics_path)
    assert [line["step"] for line in lines] == [0, 1, 2]
    by_step = step_metrics(run.path)
    assert sorted(by_step) == [0, 1]
    for metrics in by_step.values():
        assert 1 <= metrics["rollout/sampling_attempts"] <= 2
        assert metrics["rollout/groups"] >= 4
        for key in ("terminated", "truncated", "context_overflow", "max_turns", "parse_failure"):
            assert 0.0 <= metrics[f"rollout/{key}_ratio"] <= 1.0
    assert by_step[0]["val/policy_version"] == 0.0  # validated before any training
    assert "val/reward_mean" not in by_step[1]  # validation_interval=10
    assert "val/reward_mean" in lines[2] and "rollout/reward_mean" not in lines[2]

    # rollout dumps: every episode of each step, and of each validation
    for step in (0, 1):
        records = read_jsonl(run.rollouts_dir / f"train_step_{step:06d}.jsonl")
        assert len(records) == 8 * by_step[step]["rollout/groups"]
        assert all(record["task"]["prompt"] for record in records)
    for step in (0, 2):
        assert len(read_jsonl(run.rollouts_dir / f"val_step_{step:06d}.jsonl")) == num_val_tasks

    # a checkpoint after the last step, which says where the task stream stands
    (checkpoint,) = sorted(run.checkpoints_dir.iterdir())
    state = json.loads((checkpoint / "loop_state.json").read_text())
    groups_played = sum(by_step[step]["rollout/groups"] for step in (0, 1))
    assert state == {
        "step": 2,
        "task_cursor": groups_played,
        "run_name": run.path.name,
        "done_positions": [],  # async runs only
    }

    # the final model loads with transformers alone
    model = transformers.AutoModelForCausalLM.from_pretrained(run.final_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(run.final_model_dir)
    assert model.config.vocab_size == len(tokenizer)


def test_the_hosted_guides_training_example_runs_and_writes_a_complete_run_folder(
    tiny_llama_dir, tmp_path
):
    config, run, tasks = run_hosted_guide_example(tiny_llama_dir, tmp_path / "runs", val_every=50)
    check_run_folder(config, run, tasks, num_val_tasks=len(tasks[::50]))


@pytest.mark.heavy
def test_the_hosted_guides_training_example_validates_on_every_task(tiny_llama_dir, tmp_path):
    config, run, tasks = run_hosted_guide_example(tiny_llama_dir, tmp_path / "runs", val_every=1)
    check_run_folder(config, run, tasks, num_val_tasks=len(tasks))
