"""``EnvMixture``: several envs, each with its own tasks and a sampling weight, trained as one.

Real agent training mixes tasks from several envs (tinker's and prime-rl's weighted env
mixtures, verifiers' ``EnvGroup``). A mixture is what ``train_multi_turn`` takes in place of
``tasks`` and ``env_factory``::

    mixture = EnvMixture([
        MixtureEntry("game", TOOL_USE_GAME_TRAIN_TASKS, lambda task: ToolUseGameEnv(),
                     weight=2.0, val_tasks=TOOL_USE_GAME_VAL_TASKS[:40]),
        MixtureEntry("calculator", CALCULATOR_TRAIN_TASKS, lambda task: MathEnv(),
                     val_tasks=CALCULATOR_VAL_TASKS),
    ])
    train_multi_turn(config, mixture)

How it works, in the open: every task of an entry is tagged with its env's name in
``metadata["env"]`` (``env_name``). ``mixture.tasks`` holds every entry's tagged tasks and
``mixture.env_factory`` builds, for a tagged task, an env of its entry, so a mixture is also a
plain task list with one factory (``evaluate(model, mixture.val_tasks, mixture.env_factory)``).
The training loop draws each task position's env by weight (``grpo/data.py``:
``MixtureStream``), so a resumed run sees the same tasks; metrics are reported per env as well
(``rollout/<env>/…``, ``val/<env>/…``) for any tasks that carry an env name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from post_training_cookbook.envs.base import Env, Task

ENV_KEY = "env"
"""The task metadata key naming the env of a task in a mixture."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
RESERVED_NAMES = ("env",)
"""``rollout/env/…`` already holds the envs' own metrics."""


@dataclass(frozen=True)
class MixtureEntry:
    """One env of a mixture: its name (in metrics and ``metadata["env"]``), tasks, factory
    and sampling weight (relative to the others'), and its own validation tasks."""

    name: str
    tasks: Sequence[Task]
    env_factory: Callable[[Task], Env]
    weight: float = 1.0
    val_tasks: Sequence[Task] = field(default=())


class EnvMixture:
    """Envs sampled by weight; each task trains and validates on its own entry's env."""

    def __init__(self, entries: Sequence[MixtureEntry]) -> None:
        if isinstance(entries, MixtureEntry | str | bytes) or not hasattr(entries, "__iter__"):
            raise ValueError(
                f"an EnvMixture takes a list of MixtureEntry, got a {type(entries).__name__}"
            )
        entries = list(entries)
        if not entries:
            raise ValueError("an EnvMixture needs at least one MixtureEntry")
        for index, entry in enumerate(entries):
            if not isinstance(entry, MixtureEntry):
                raise ValueError(
                    f"EnvMixture entry {index} is a {type(entry).__name__}, not a MixtureEntry"
                    "(name, tasks, env_factory, weight=1.0, val_tasks=())"
                )
        names = [entry.name for entry in entries]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"mixture entries need distinct names; repeated: {repeated}")
        for entry in entries:
            _check_entry(entry)
        if not math.isfinite(sum(float(entry.weight) for entry in entries)):
            raise ValueError(
                "mixture weights sum past what a float holds: weights are relative, so scale "
                "them down (e.g. divide each by the largest)"
            )
        self.entries = tuple(
            MixtureEntry(
                entry.name,
                tagged(entry.name, entry.tasks),
                entry.env_factory,
                float(entry.weight),
                tagged(entry.name, entry.val_tasks),
            )
            for entry in entries
        )
        self._by_name = {entry.name: entry for entry in self.entries}

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    @property
    def weights(self) -> list[float]:
        return [entry.weight for entry in self.entries]

    @property
    def tasks(self) -> list[Task]:
        """Every entry's training tasks, tagged with their env's name."""
        return [task for entry in self.entries for task in entry.tasks]

    @property
    def val_tasks(self) -> list[Task]:
        """Every entry's validation tasks, tagged: validation covers each env in full."""
        return [task for entry in self.entries for task in entry.val_tasks]

    def env_factory(self, task: Task) -> Env:
        """An env of the entry ``task`` belongs to, from that entry's factory."""
        name = env_name(task)
        entry = self._by_name.get(name or "")
        if entry is None:
            raise ValueError(
                f"task {task.prompt[:80]!r} names no env of this mixture (metadata[{ENV_KEY!r}]"
                f" = {name!r}; the envs: {', '.join(self.names)})"
            )
        return entry.env_factory(task)

    def __repr__(self) -> str:
        parts = ", ".join(f"{e.name}: {len(e.tasks)} tasks × {e.weight:g}" for e in self.entries)
        return f"EnvMixture({parts})"


def env_name(task: Task) -> str | None:
    """The name of the env ``task`` belongs to in a mixture; None for a task of no mixture."""
    name = task.metadata.get(ENV_KEY) if isinstance(task.metadata, dict) else None
    return name if isinstance(name, str) else None


def tagged(name: str, tasks: Sequence[Task]) -> tuple[Task, ...]:
    """``tasks`` with ``metadata["env"] = name``; ``ValueError`` for a task tagged otherwise."""
    result = []
    for task in tasks:
        if not isinstance(task, Task):
            raise ValueError(
                f"mixture entry {name!r}: tasks must be Task objects, got {task!r:.80}"
            )
        current = env_name(task)
        if current is not None and current != name:
            raise ValueError(
                f"mixture entry {name!r}: task {task.prompt[:80]!r} already names env "
                f"{current!r} in metadata[{ENV_KEY!r}]"
            )
        result.append(Task(task.prompt, task.target, {**task.metadata, ENV_KEY: name}))
    return tuple(result)


def _check_entry(entry: MixtureEntry) -> None:
    if not isinstance(entry.name, str) or not _NAME.fullmatch(entry.name):
        raise ValueError(
            f"mixture entry name {entry.name!r}: use letters, digits, '.', '_' or '-' "
            "(it is part of metric keys and of metadata)"
        )
    if entry.name in RESERVED_NAMES:
        raise ValueError(f"mixture entry name {entry.name!r} is reserved: rollout/env/… exists")
    if not entry.tasks:
        raise ValueError(f"mixture entry {entry.name!r} has no tasks")
    if not callable(entry.env_factory):
        raise ValueError(f"mixture entry {entry.name!r}: env_factory must be a callable")
    weight = entry.weight
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"mixture entry {entry.name!r}: weight must be a number, got {weight!r}")
    try:
        finite = math.isfinite(float(weight))
    except OverflowError:  # an int past what a float holds
        finite = False
    if not finite:
        raise ValueError(
            f"mixture entry {entry.name!r}: weight must be a number, finite and within a float, "
            f"got {weight!r:.40}"
        )
    if weight <= 0:
        raise ValueError(f"mixture entry {entry.name!r}: weight must be > 0, got {weight}")
