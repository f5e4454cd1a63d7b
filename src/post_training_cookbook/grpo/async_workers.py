"""The rollout side of async GRPO: workers that keep playing groups, each stamped with the
policy version it started under; the gate that lets a worker start only a group some step can
still admit; and the ledger of task positions, so that a resumed run loses and replays none.
The step side (admission, training) is ``async_loop``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.grpo.data import TaskSource
from post_training_cookbook.grpo.settings import AsyncSettings, StepSettings
from post_training_cookbook.rollout import EpisodeRunner, Group, derive_seed, play_group
from post_training_cookbook.service.base import ModelService


@dataclass(frozen=True)
class StampedGroup:
    group: Group
    position: int
    """The task's position in the run's task stream."""
    start_version: int


class PositionLedger:
    """Which task positions are done, compactly: everything below ``low_water`` plus a set."""

    def __init__(self, low_water: int = 0, done_above: Sequence[int] = ()) -> None:
        self.low_water = low_water
        self.done_above = set(done_above)

    def mark_done(self, position: int) -> None:
        self.done_above.add(position)
        while self.low_water in self.done_above:
            self.done_above.remove(self.low_water)
            self.low_water += 1

    def positions_to_hand_out(self, start: int | None = None) -> PositionIterator:
        return PositionIterator(self, self.low_water if start is None else start)


@dataclass
class PositionIterator:
    ledger: PositionLedger
    next_position: int

    def take(self) -> int:
        while self.next_position in self.ledger.done_above:
            self.next_position += 1
        position = self.next_position
        self.next_position += 1
        return position


class StartGate:
    """Whether a rollout worker may start a group now, so that rollouts are not made only to
    be dropped as stale.

    A group started at version ``v`` can be admitted by the steps whose trainer version is at
    most ``v + max_steps_off_policy``. Groups are admitted roughly in the order they start,
    so a new group fits if the groups already outstanding (in flight or queued) leave room
    in those steps: what the step being admitted still needs, plus ``batch_size`` for each
    later step. The bound counts a step as ``batch_size`` groups; dynamic sampling asks for
    more, which the gate grants as the admission asks.
    """

    def __init__(
        self, batch_size: int, max_steps_off_policy: int, trainer_version: int = 0
    ) -> None:
        self._batch_size = batch_size
        self._max_age = max_steps_off_policy
        self.outstanding = 0
        """Groups started and not yet taken by an admission."""
        self.next_version = trainer_version
        """Trainer version of the next (or current) admission."""
        self.still_needed = batch_size
        """Groups the next (or current) admission still needs."""
        self._changed = asyncio.Event()

    def room(self, start_version: int) -> int:
        later_steps = start_version + self._max_age - self.next_version
        if later_steps < 0:
            return 0  # it would be stale by the time any step could admit it
        return self.still_needed + later_steps * self._batch_size - self.outstanding

    async def enter(self, current_version: Callable[[], int]) -> int:
        """Wait for room; return the version the new group starts under."""
        while True:
            version = current_version()
            if self.room(version) > 0:
                self.outstanding += 1
                return version
            self._changed.clear()
            # deferred publishes change the version from another thread: poll as well
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=0.02)

    def admitting(self, trainer_version: int, still_needed: int) -> None:
        self.next_version, self.still_needed = trainer_version, still_needed
        self._changed.set()

    def taken(self) -> None:
        self.outstanding -= 1
        self._changed.set()


class RolloutWorkers:
    """``groups_in_flight`` workers, each playing one group at a time, stamped with the
    policy version the generators had when it started."""

    def __init__(
        self,
        episodes: EpisodeRunner,
        service: ModelService,
        stream: TaskSource,
        ledger: PositionLedger,
        params: SamplingParams,
        steps: StepSettings,
        async_settings: AsyncSettings,
    ) -> None:
        self._episodes = episodes
        self._service = service
        self._stream = stream
        self._positions = ledger.positions_to_hand_out()
        self._params = params
        self._steps = steps
        self._num_workers = async_settings.groups_in_flight
        self.queue: asyncio.Queue[StampedGroup] = asyncio.Queue()
        """Finished groups, in the order they finished; admissions move them to ``ready``."""
        self.ready: list[StampedGroup] = []
        """Finished groups no admission has taken yet."""
        self.playing: Counter[int] = Counter()
        """Groups being played, by start version."""
        # a resumed run starts at its checkpoint's version, not 0
        self.gate = StartGate(
            steps.batch_size,
            async_settings.max_steps_off_policy,
            service.policy_state().trainer_step,
        )
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for _ in range(self._num_workers):
            self._workers.append(asyncio.create_task(self._work()))

    async def _work(self) -> None:
        service, steps = self._service, self._steps
        while True:
            version = await self.gate.enter(lambda: service.policy_state().applied_weights_version)
            position = self._positions.take()
            task = self._stream.at(position)
            seed = derive_seed(steps.seed, "train", position)
            self.playing[version] += 1
            try:
                group = await play_group(
                    self._episodes, task, steps.episodes_per_task, self._params, seed
                )
            finally:
                self.playing[version] -= 1
            await self.queue.put(StampedGroup(group, position, version))

    async def next_group(self, last_chance: int, still_needed: int) -> StampedGroup:
        """The group an admission takes next: the oldest finished one. ``last_chance`` is the
        oldest start version the step may admit; a younger group waits (a later step can take
        it) while the groups of ``last_chance`` still playing could fill ``still_needed``."""
        while True:
            self.raise_if_failed()
            while not self.queue.empty():
                self.ready.append(self.queue.get_nowait())
            if self.ready:
                oldest = min(self.ready, key=lambda stamped: stamped.start_version)
                if oldest.start_version <= last_chance or self.playing[last_chance] < still_needed:
                    self.ready.remove(oldest)
                    return oldest
            with contextlib.suppress(TimeoutError):
                self.ready.append(await asyncio.wait_for(self.queue.get(), timeout=0.5))

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

    def raise_if_failed(self) -> None:
        """A worker that died (an env error under ``env_errors="raise"``) stops the run."""
        for worker in self._workers:
            if worker.done() and not worker.cancelled() and worker.exception() is not None:
                raise worker.exception()  # type: ignore[misc]
