"""Pre-flight checks of what episodes will be played on: run before any weights load, by the
training loop and by evaluation alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from post_training_cookbook.envs.base import Env, Task


def check_episode_inputs(
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    *,
    purpose: Literal["train", "evaluate"],
    val_tasks: Sequence[Task] = (),
) -> None:
    """``ValueError`` naming what is wrong with the tasks or the env factory."""
    if not tasks:
        raise ValueError(f"tasks is empty: pass at least one Task to {purpose} on")
    if not all(isinstance(task, Task) for task in [*tasks, *val_tasks]):
        which = "tasks and val_tasks" if purpose == "train" else "tasks"
        raise ValueError(f"{which} must hold post_training_cookbook.envs.Task objects")
    if not callable(env_factory):
        raise ValueError("env_factory must be a callable that builds a fresh Env for a task")
