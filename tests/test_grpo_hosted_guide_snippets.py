"""The hosted guide's other two calls, made as the page describes them, and training from a
notebook (inside a running event loop).

- "To train on your own environment, pass your Task list as tasks and a factory such as
  ``lambda task: MathEnv()`` as env_factory": the training example's config with the hosted guide's
  own ``MathEnv`` and no ``val_tasks``.
- "pass a config like the following to train_multi_turn with your tasks and an environment
  factory": the async config as written, no ``val_tasks``.

Only ``model`` (the bundled model id) and ``num_steps`` (few) differ from the page; W&B logs
offline and the runs land in a temporary working directory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_grpo_common import (
    Closes,
    ScriptedPolicy,
    mode_envs,
    mode_tasks,
    quick_config,
    read_jsonl,
    step_metrics,
)
from test_hosted_guide_math_env import MathEnv

from post_training_cookbook.bundled_envs.calculator import calculator_tasks
from post_training_cookbook.envs import Task
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn, train_single_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID

VALIDATION_OFF = "validation is off: validation_interval=10 needs val_tasks"


@pytest.fixture
def in_a_fresh_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return tmp_path


def printed(capfd: pytest.CaptureFixture[str]) -> str:
    captured = capfd.readouterr()
    return captured.out + captured.err


def only_run(folder: Path) -> Path:
    (run,) = [path for path in (folder / "runs").iterdir() if path.is_dir()]
    return run


def test_the_training_example_trains_on_your_own_env_with_only_tasks_and_a_factory(
    in_a_fresh_folder: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tasks = calculator_tasks(num_train=8, num_val=0)

    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,  # changed: "Qwen/Qwen3.8-27B"
        batch_size=4,
        episodes_per_task=8,
        num_steps=2,  # changed: 200
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-5,
        wandb_project="grpo-tool-use-game",
        sequential_validation=True,
        max_sampling_attempts=2,
    )

    run = train_multi_turn(config, tasks=tasks, env_factory=lambda task: MathEnv())

    assert run.path.resolve() == only_run(in_a_fresh_folder)
    assert sorted(step_metrics(run.path)) == [0, 1]
    assert not list(run.rollouts_dir.glob("val_*"))  # no validation without val_tasks
    assert all("val/reward_mean" not in line for line in read_jsonl(run.metrics_path))
    assert (run.final_model_dir / "config.json").is_file()
    assert printed(capfd).count(VALIDATION_OFF) == 1  # said once


def test_the_async_example_config_trains_with_your_tasks_and_an_env_factory(
    in_a_fresh_folder: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,  # changed: "Qwen/Qwen3.6-35B-A3B"
        max_turns=6,
        batch_size=4,
        episodes_per_task=8,
        max_steps_off_policy=1,
        groups_in_flight=8,
        num_generator_replicas=2,
        num_steps=2,  # added: the default is 100
    )

    run = train_multi_turn(
        config, tasks=list(TOOL_USE_GAME_TASKS), env_factory=lambda task: ToolUseGameEnv()
    )

    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1]
    assert all("async/train_wait_s" in line for line in metrics.values())
    assert (run.final_model_dir / "config.json").is_file()
    assert printed(capfd).count(VALIDATION_OFF) == 1


def test_both_entry_points_train_when_called_inside_a_running_event_loop(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch
) -> None:
    """A notebook cell runs inside the kernel's event loop, where ``asyncio.run`` refuses."""
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)
    tasks = mode_tasks(["answer", "wrong"])

    async def notebook_cell() -> tuple[Path, Path]:
        asyncio.get_running_loop()  # as in Jupyter: a loop is running here
        multi = train_multi_turn(
            quick_config(tiny_llama_dir, tmp_path, run_name="multi"), tasks, mode_envs(Closes())
        )
        single = train_single_turn(
            quick_config(tiny_llama_dir, tmp_path, run_name="single"),
            [Task("What is 0 + 1? mode=answer", "1")],  # the scripted policy answers "1"
            lambda reply, target: float(reply.strip() == target),
        )
        return multi.path, single.path

    multi, single = asyncio.run(notebook_cell())
    assert sorted(step_metrics(multi)) == [0]
    assert sorted(step_metrics(single)) == [0]


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        ("Qwen/Qwen3.8-27B", {"batch_size": 4, "episodes_per_task": 8, "num_steps": 200,
                              "validation_interval": 10, "max_turns": 6, "max_model_length": 2048,
                              "learning_rate": 2e-5, "wandb_project": "grpo-tool-use-game",
                              "sequential_validation": True, "max_sampling_attempts": 2}),
        ("Qwen/Qwen3.6-35B-A3B", {"max_turns": 6, "batch_size": 4, "episodes_per_task": 8,
                                  "max_steps_off_policy": 1, "groups_in_flight": 8,
                                  "num_generator_replicas": 2}),
    ],
)  # fmt: skip
def test_the_hosted_guide_examples_with_their_own_model_ids_fail_here_only_for_want_of_weights(
    in_a_fresh_folder: Path, monkeypatch: pytest.MonkeyPatch, model: str, fields: dict
) -> None:
    """Exactly the page's configs: on a machine without the weights, the one error names the
    model and how to provide it, before any env starts or anything loads."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(in_a_fresh_folder / "hub"))
    built = Closes()
    config = GRPOConfig(model=model, **fields)
    with pytest.raises(ValueError) as error:
        train_multi_turn(config, tasks=list(TOOL_USE_GAME_TASKS), env_factory=mode_envs(built))
    message = str(error.value)
    assert f"'{model}'" in message and f"hf download {model}" in message
    assert built.built == 0 and not (in_a_fresh_folder / "runs").exists()
