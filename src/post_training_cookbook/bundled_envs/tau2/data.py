"""τ²-bench's tasks as the cookbook's ``Task``: one task, one episode of ``Tau2Env``.

Each ``Task`` carries the whole τ² task (``metadata["tau2"]["task"]``, τ²'s own JSON of it),
so an episode needs nothing but the task, a rollout dump shows what was asked, and a task of
your own (``Tau2Task.model_validate(...)``, as τ² writes them) plays like a published one.
``prompt`` is what the episode is about, for logs and dumps: the ticket in solo mode, else
the user's reason for the call; ``target`` is empty (τ²'s evaluator scores the episode).
"""

from __future__ import annotations

import functools
from typing import Any

from post_training_cookbook.bundled_envs import task_record
from post_training_cookbook.bundled_envs.tau2.package import DOMAINS, SOLO_DOMAINS, tau2
from post_training_cookbook.envs.base import Task

METADATA_KEY = "tau2"


def tau2_tasks(
    domain: str, split: str | None = "base", *, solo: bool = False, limit: int | None = None
) -> list[Task]:
    """The tasks of a τ² domain (``airline``, ``retail``, ``telecom``) in one of τ²'s
    splits (``base``, the published benchmark, by default; ``train``, ``test``; telecom also
    ``small`` and ``full``; ``None``: every task of the domain's task file). ``solo=True``:
    the tasks solo mode can play (those with a ticket), for ``Tau2Env(solo=True)``."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown τ² domain {domain!r}; the domains are {', '.join(DOMAINS)}")
    if solo and domain not in SOLO_DOMAINS:
        raise ValueError(
            f"τ²'s {domain} domain has no solo mode (its tasks have no ticket); "
            f"solo mode: {', '.join(SOLO_DOMAINS)}"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    splits = task_splits(domain)
    if split is not None and split not in splits:
        raise ValueError(
            f"τ²'s {domain} domain has no split {split!r}; its splits: {', '.join(splits)}"
        )
    tasks = load_tau2_tasks(domain, split)
    if solo:
        tasks = [task for task in tasks if tau2().agents.LLMSoloAgent.check_valid_task(task)]
    return [to_task(domain, task, solo=solo) for task in tasks[:limit]]


@functools.cache
def task_splits(domain: str) -> dict[str, tuple[str, ...]]:
    """τ²'s named splits of a domain's tasks: split name → task ids."""
    loader = tau2().registry.get_task_splits_loader(domain)
    splits = loader() if loader is not None else {}
    return {name: tuple(ids) for name, ids in (splits or {}).items()}


def load_tau2_tasks(domain: str, split: str | None) -> list[Any]:
    """τ²'s own task records (``tau2.data_model.tasks.Task``), fresh copies."""
    return [task.model_copy(deep=True) for task in _loaded(domain, split)]


@functools.cache
def _loaded(domain: str, split: str | None) -> tuple[Any, ...]:
    return tuple(tau2().registry.get_tasks_loader(domain)(split))


def to_task(domain: str, task: Any, *, solo: bool = False) -> Task:
    """A τ² task record (``tau2.data_model.tasks.Task``) of ``domain`` as our ``Task``."""
    if solo:
        prompt = task.ticket or ""
    else:
        instructions = task.user_scenario.instructions
        prompt = getattr(instructions, "reason_for_call", None) or str(instructions)
    return Task(
        prompt=prompt,
        metadata={
            METADATA_KEY: {
                "domain": domain,
                "id": task.id,
                "solo": solo,
                "task": task.model_dump(mode="json"),
            }
        },
    )


def from_task(task: Task) -> tuple[str, Any]:
    """The domain and the τ² task record a ``Task`` from ``tau2_tasks`` carries."""
    data = task_record(task, METADATA_KEY, "τ²", "tau2_tasks()")
    if not isinstance(data.get("task"), dict):
        raise ValueError(f"task {task.prompt!r:.60}: its τ² record has no task")
    domain = data.get("domain")
    if domain not in DOMAINS:
        raise ValueError(f"task {task.prompt!r:.60}: unknown τ² domain {domain!r}")
    return domain, tau2().tasks.Task.model_validate(data["task"])
