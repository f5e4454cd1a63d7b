"""The first round's findings that remained: a generator as ``tasks`` (used up by one pass),
a task whose prompt is not a string, and an env class whose constructor takes no task
passed as the factory (``ToolEnv`` would get the task as its ``tools``): each a
``ValueError`` saying what to pass, before any model loads."""

from __future__ import annotations

from typing import Any

import pytest

from post_training_cookbook.envs import Task, ToolEnv
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.rollout.checks import check_episode_inputs


class QuizEnv(ToolEnv):
    def __init__(self, tools: Any = (), *, system_prompt: str | None = None) -> None:
        super().__init__(tools, system_prompt=system_prompt, reward_fn=lambda answer, task: 1.0)


class TaskEnv(ToolUseGameEnv):
    def __init__(self, task: Task) -> None:
        super().__init__()
        self.given = task


def factory(task: Task) -> ToolUseGameEnv:
    return ToolUseGameEnv()


@pytest.mark.parametrize(
    ("tasks", "env_factory", "words"),
    [
        ((t for t in TOOL_USE_GAME_TASKS[:3]), factory, r"a generator is used up.*list\(tasks\)"),
        ([Task(prompt=5)], factory, "prompt is a int"),  # type: ignore[arg-type]
        ([Task(prompt=["hi"])], factory, "prompt is a list"),  # type: ignore[arg-type]
        (TOOL_USE_GAME_TASKS[:2], QuizEnv, r"the class QuizEnv.*lambda task: QuizEnv\(\)"),
    ],
    ids=["generator", "int prompt", "list prompt", "env class as factory"],
)
def test_inputs_that_would_fail_or_train_silently_are_refused(tasks, env_factory, words) -> None:
    with pytest.raises(ValueError, match=words):
        check_episode_inputs(tasks, env_factory, purpose="train")


def test_an_env_class_that_takes_the_task_is_a_factory() -> None:
    check_episode_inputs(TOOL_USE_GAME_TASKS[:2], TaskEnv, purpose="train")
    check_episode_inputs(TOOL_USE_GAME_TASKS[:2], factory, purpose="evaluate")


def test_train_multi_turn_refuses_a_generator_before_any_model_loads(tmp_path) -> None:
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.grpo.train import train_multi_turn

    config = GRPOConfig(runs_dir=str(tmp_path), run_name="r", wandb_project=None)
    with pytest.raises(ValueError, match="a generator is used up"):
        train_multi_turn(config, (t for t in TOOL_USE_GAME_TASKS[:4]), factory)
    assert not (tmp_path / "r").exists()
