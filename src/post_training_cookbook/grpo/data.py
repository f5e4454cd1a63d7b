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

    def _epoch_order(self, epoch: int) -> list[int]:
        return random.Random(f"{self._seed}/{epoch}").sample(
            range(len(self._tasks)), len(self._tasks)
        )

    def take(self, count: int) -> list[Task]:
        taken = []
        for _ in range(count):
            epoch, index = divmod(self.cursor, len(self._tasks))
            taken.append(self._tasks[self._epoch_order(epoch)[index]])
            self.cursor += 1
        return taken
