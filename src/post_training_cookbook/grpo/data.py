"""Which tasks each step trains on: a seeded shuffle, epoch after epoch, with a cursor.

The cursor (tasks handed out so far) is saved with every checkpoint, so a resumed run sees
the same tasks in the same order as an uninterrupted one. A stream is a pure function of its
seed and a position (``at``), which is what async runs rely on: they hand positions out of
order through a ledger.

A mixture of envs (``EnvMixture``) gets a ``MixtureStream``: each position's env is drawn by
weight from a seeded sequence, and its task is that env's next one from a ``TaskStream`` of
its own. So over many positions each env's share is its weight's, each env goes through its
tasks epoch by epoch, and a resumed run (which rebuilds the sequence up to its cursor) sees
the same tasks again.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Sequence

from post_training_cookbook.envs.base import Task
from post_training_cookbook.envs.mixture import EnvMixture
from post_training_cookbook.rollout import derive_seed


class _Positions:
    """What both streams share: ``take`` hands out the next positions from the cursor."""

    cursor: int

    def at(self, position: int) -> Task:
        raise NotImplementedError

    def take(self, count: int) -> list[tuple[int, Task]]:
        """The next ``count`` (position, task) pairs; the cursor moves past them."""
        taken = [
            (position, self.at(position)) for position in range(self.cursor, self.cursor + count)
        ]
        self.cursor += count
        return taken


class TaskStream(_Positions):
    def __init__(self, tasks: Sequence[Task], seed: int, cursor: int = 0) -> None:
        if not tasks:
            raise ValueError("tasks is empty: pass at least one Task to train on")
        self._tasks = list(tasks)
        self._seed = seed
        self.cursor = cursor
        self._orders: dict[int, list[int]] = {}
        """Shuffles of the epochs in use: async workers hand out positions near the
        cursor, so at most two epochs are kept."""

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = random.Random(f"{self._seed}/{epoch}").sample(
                range(len(self._tasks)), len(self._tasks)
            )
        return self._orders[epoch]

    def at(self, position: int) -> Task:
        """The task at ``position`` of the stream (the cursor does not move)."""
        epoch, index = divmod(position, len(self._tasks))
        return self._tasks[self._epoch_order(epoch)[index]]


class MixtureStream(_Positions):
    """Positions of a weighted mixture: an env drawn by weight, then that env's next task."""

    def __init__(self, mixture: EnvMixture, seed: int, cursor: int = 0) -> None:
        self._streams = [
            TaskStream(entry.tasks, derive_seed(seed, "mixture", entry.name))
            for entry in mixture.entries
        ]
        self._cumulative = list(itertools.accumulate(mixture.weights))
        self._draws = random.Random(f"{seed}/mixture")
        self._env_at = array("q")
        """Per position drawn so far: the index of its env..."""
        self._ordinal_at = array("q")
        """...and how many positions before it drew that env (its place in the env's stream)."""
        self._counts = [0] * len(self._streams)
        self.cursor = cursor

    def env_index(self, position: int) -> int:
        """Which entry of the mixture ``position`` draws."""
        while len(self._env_at) <= position:
            (index,) = self._draws.choices(range(len(self._streams)), cum_weights=self._cumulative)
            self._env_at.append(index)
            self._ordinal_at.append(self._counts[index])
            self._counts[index] += 1
        return self._env_at[position]

    def at(self, position: int) -> Task:
        index = self.env_index(position)
        return self._streams[index].at(self._ordinal_at[position])


TaskSource = TaskStream | MixtureStream
"""What the loops draw task positions from."""


def task_stream(tasks: Sequence[Task] | EnvMixture, seed: int, cursor: int = 0) -> TaskSource:
    """The stream of a task list, or of a mixture."""
    if isinstance(tasks, EnvMixture):
        return MixtureStream(tasks, seed, cursor)
    return TaskStream(tasks, seed, cursor)
