"""Which tasks each step trains on: a seeded shuffle, epoch after epoch, with a cursor.

The cursor (tasks handed out so far) is saved with every checkpoint, so a resumed run sees
the same tasks in the same order as an uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from post_training_cookbook.envs.base import Task


class TaskStream:
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

    def take(self, count: int) -> list[tuple[int, Task]]:
        """The next ``count`` (position, task) pairs; the cursor moves past them."""
        taken = [
            (position, self.at(position)) for position in range(self.cursor, self.cursor + count)
        ]
        self.cursor += count
        return taken
