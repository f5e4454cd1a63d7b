"""Pre-flight checks of what episodes will be played on: run before any weights load, by the
training loop and by evaluation alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from post_training_cookbook.envs.base import Env, Task, env_class_parameters
from post_training_cookbook.rollout.types import Group, TruncationCause


def check_episode_inputs(
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    *,
    purpose: Literal["train", "evaluate"],
    val_tasks: Sequence[Task] = (),
) -> None:
    """``ValueError`` naming what is wrong with the tasks or the env factory."""
    for name, given in (("tasks", tasks), ("val_tasks", val_tasks)):
        if not isinstance(given, Sequence) or isinstance(given, str | bytes):
            raise ValueError(
                f"{name} must be a list (or another sequence) of Task, got a "
                f"{type(given).__name__}: a generator is used up by one pass, and a run "
                f"reads its tasks epoch after epoch; pass list({name})"
            )
    if not tasks:
        raise ValueError(f"tasks is empty: pass at least one Task to {purpose} on")
    if not all(isinstance(task, Task) for task in [*tasks, *val_tasks]):
        which = "tasks and val_tasks" if purpose == "train" else "tasks"
        raise ValueError(f"{which} must hold post_training_cookbook.envs.Task objects")
    for task in [*tasks, *val_tasks]:
        if not isinstance(task.prompt, str):
            raise ValueError(
                f"a task's prompt is a {type(task.prompt).__name__} ({task.prompt!r:.60}): "
                "Task.prompt is the user's message, a string"
            )
    if not callable(env_factory):
        raise ValueError("env_factory must be a callable that builds a fresh Env for a task")
    if _is_env_class_taking_no_task(env_factory):
        name = getattr(env_factory, "__name__", "MyEnv")
        raise ValueError(
            f"env_factory is the class {name}, whose constructor needs no task: the loop "
            f"would call {name}(task), passing the task as its first argument; pass "
            f"env_factory=lambda task: {name}()"
        )


def _is_env_class_taking_no_task(factory: object) -> bool:
    """An ``Env`` class that can be built with no arguments: ``env_factory=MyEnv`` then
    hands the task to a parameter meant for something else (``ToolEnv``'s ``tools``)."""
    parameters = env_class_parameters(factory)
    if parameters is None:
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional or positional[0].name == "task":
        return False
    return all(p.default is not p.empty for p in positional)


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
