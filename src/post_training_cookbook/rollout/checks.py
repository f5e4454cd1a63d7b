"""Pre-flight checks of what episodes will be played on: run before any weights load, by the
training loop and by evaluation alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.rollout.types import Group, TruncationCause


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


class UnusableRolloutsError(RuntimeError):
    """A whole step (or validation) gave nothing to learn from or to measure: every episode
    ended in an env error, or none sampled a token."""


def check_rollouts_usable(groups: Sequence[Group], what: str, max_model_length: int) -> None:
    """Raise ``UnusableRolloutsError`` for groups a run must not go on with silently."""
    episodes = [episode for group in groups for episode in group.episodes]
    if not episodes:
        return
    if all(episode.env_error is not None for episode in episodes):
        first = episodes[0]
        raise UnusableRolloutsError(
            f"every episode of {what} ended in an env error, e.g. {first.env_error} (task "
            f"{first.task.prompt!r}); the run would learn nothing: fix the env "
            "(post_training_cookbook.envs.check_env reports what breaks its contract)"
        )
    if any(episode.num_sampled_tokens for episode in episodes):
        return
    lengths = sorted(len(episode.tokens) for episode in episodes)
    if all(episode.truncation is TruncationCause.CONTEXT_OVERFLOW for episode in episodes):
        raise UnusableRolloutsError(
            f"no episode of {what} sampled a token: the prompts ({lengths[0]}-{lengths[-1]} "
            f"tokens) leave no room within max_model_length={max_model_length}; raise "
            "max_model_length or shorten the prompts"
        )
    endings = sorted({str(e.truncation.value if e.truncation else "terminated") for e in episodes})
    raise UnusableRolloutsError(
        f"no episode of {what} sampled a token (endings: {', '.join(endings)})"
    )
