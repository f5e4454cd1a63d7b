"""Async admission: stale groups are dropped and counted apart; the ledger never loses or
replays a task position."""

import asyncio
from collections import Counter

from post_training_cookbook.envs import Task
from post_training_cookbook.grpo.async_loop import admit_groups
from post_training_cookbook.grpo.async_workers import (
    PositionLedger,
    RolloutWorkers,
    StampedGroup,
    StartGate,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.rollout import Episode, Group


def episode(reward: float) -> Episode:
    return Episode(Task("q"), [1, 2], [0.0, 1.0], [0.0, -0.1], [-1, 0], reward=reward)


def group(rewards: list[float]) -> Group:
    return Group(Task("q"), [episode(r) for r in rewards])


class QueueOnly(RolloutWorkers):
    """Real admission against a hand-filled queue (no workers running)."""

    def __init__(self, stamped: list[StampedGroup]) -> None:
        self.queue = asyncio.Queue()
        self.ready = []
        self.playing = Counter()
        self._workers = []
        self.gate = start_gate(config())
        self.gate.outstanding = len(stamped)
        for item in stamped:
            self.queue.put_nowait(item)


def admit_groups_of(workers, ledger, config: GRPOConfig, trainer_version: int):
    """``admit_groups`` with the step settings a run of ``config`` would have."""
    steps = RunSettings.from_config(config, resolve_model(BUNDLED_MODEL_ID)).steps
    return admit_groups(workers, ledger, steps, config.max_steps_off_policy, trainer_version)


def start_gate(config: GRPOConfig, trainer_version: int = 0) -> StartGate:
    return StartGate(config.batch_size, config.max_steps_off_policy, trainer_version)


def config(**overrides) -> GRPOConfig:
    values = {
        "batch_size": 2,
        "episodes_per_task": 2,
        "max_steps_off_policy": 1,
        "wandb_project": None,
    }
    return GRPOConfig(**{**values, **overrides})


def test_a_group_older_than_max_steps_off_policy_is_dropped_and_counted_as_stale():
    stamped = [
        StampedGroup(group([0.0, 1.0]), position=0, start_version=3),  # age 2: stale
        StampedGroup(group([1.0, 1.0]), position=1, start_version=4),  # age 1: no variance
        StampedGroup(group([0.0, 1.0]), position=2, start_version=5),  # age 0
        StampedGroup(group([1.0, 0.0]), position=3, start_version=5),
    ]
    ledger = PositionLedger()

    async def admit():
        return await admit_groups_of(QueueOnly(stamped), ledger, config(max_sampling_attempts=2), 5)

    admission = asyncio.run(admit())
    metrics = admission.metrics()
    assert admission.dropped_stale == 1
    assert [s.position for s in admission.admitted] == [1, 2, 3]
    assert metrics["async/dropped_stale_groups"] == 1.0
    # the stale group is not a zero-variance skip: 1 of the 3 admitted groups is
    assert metrics["rollout/zero_variance_skip_ratio"] == 1 / 3
    assert metrics["async/policy_age_max"] == 1.0
    assert ledger.low_water == 4


def test_a_group_on_its_last_chance_is_waited_for_instead_of_overtaken():
    young = StampedGroup(group([0.0, 1.0]), position=1, start_version=5)
    last_chance = StampedGroup(group([1.0, 0.0]), position=0, start_version=4)

    async def admit(still_playing: bool):
        workers = QueueOnly([young])
        workers.gate.outstanding = 2
        if still_playing:
            workers.playing[4] = 1  # position 0, started at version 4, is still being played

            async def finish():
                await asyncio.sleep(0.05)
                workers.playing[4] -= 1
                await workers.queue.put(last_chance)

            finishing = asyncio.create_task(finish())
        admission = await admit_groups_of(workers, PositionLedger(), config(batch_size=1), 5)
        if still_playing:
            await finishing
        return admission, workers.ready

    admission, left = asyncio.run(admit(still_playing=True))
    # at version 5 with N=1, this step is the last that can take a group started at 4
    assert [s.position for s in admission.admitted] == [0] and admission.dropped_stale == 0
    assert admission.wait_s >= 0.04 and left == [young]  # the next step can still take it
    admission, left = asyncio.run(admit(still_playing=False))
    assert [s.position for s in admission.admitted] == [1] and left == []


def test_max_steps_off_policy_zero_admits_only_groups_of_the_current_policy():
    stamped = [
        StampedGroup(group([0.0, 1.0]), position=i, start_version=v)
        for i, v in enumerate([6, 7, 7])
    ]

    async def admit():
        return await admit_groups_of(
            QueueOnly(stamped), PositionLedger(), config(max_steps_off_policy=0), 7
        )

    admission = asyncio.run(admit())
    assert admission.dropped_stale == 1 and len(admission.admitted) == 2


def test_the_dynamic_sampling_budget_bounds_how_many_fresh_groups_a_step_admits():
    stamped = [StampedGroup(group([1.0, 1.0]), position=i, start_version=0) for i in range(5)]

    async def admit():
        return await admit_groups_of(QueueOnly(stamped), PositionLedger(), config(), 0)

    admission = asyncio.run(admit())
    assert len(admission.admitted) == 2  # max_sampling_attempts (1) x batch_size (2)


def test_the_ledger_hands_out_every_position_not_done_exactly_once_after_a_resume():
    ledger = PositionLedger()
    handed = ledger.positions_to_hand_out()
    first = [handed.take() for _ in range(6)]  # 6 positions in flight
    for position in (0, 1, 3, 5):  # 2 and 4 were still in flight at the checkpoint
        ledger.mark_done(position)
    saved = (ledger.low_water, sorted(ledger.done_above))
    resumed = PositionLedger(*saved).positions_to_hand_out()
    again = [resumed.take() for _ in range(4)]
    assert first == [0, 1, 2, 3, 4, 5]
    assert saved == (2, [3, 5])
    assert again == [2, 4, 6, 7]  # nothing lost (2, 4), nothing replayed (3, 5)


def test_the_start_gate_lets_a_group_start_only_if_a_step_can_still_admit_it():
    gate = start_gate(config(batch_size=4, max_steps_off_policy=1))
    gate.admitting(trainer_version=5, still_needed=3)  # step at version 5 needs 3 more
    assert gate.room(start_version=5) == 3 + 4  # this step's 3 and the next step's 4
    assert gate.room(start_version=4) == 3  # only this step can still admit it
    assert gate.room(start_version=3) == 0  # stale before any step could admit it
    gate.outstanding = 6
    assert gate.room(start_version=5) == 1
    gate.admitting(trainer_version=6, still_needed=4)  # training: the next step fills
    assert gate.room(start_version=5) == 4 - 6  # full: wait for an admission
    resumed = start_gate(config(batch_size=4, max_steps_off_policy=1), trainer_version=10)
    assert resumed.room(start_version=10) == 4 + 4  # not 11 steps' worth: it starts at 10
    zero = start_gate(config(batch_size=2, max_steps_off_policy=0))
    zero.admitting(trainer_version=2, still_needed=2)
    assert zero.room(start_version=2) == 2 and zero.room(start_version=1) == 0


def test_a_worker_blocked_by_the_gate_starts_once_an_admission_takes_a_group():
    gate = start_gate(config(batch_size=1, max_steps_off_policy=0))
    gate.admitting(trainer_version=0, still_needed=1)

    async def scenario():
        assert await gate.enter(lambda: 0) == 0  # room for one group
        blocked = asyncio.create_task(gate.enter(lambda: 0))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        gate.taken()  # the admission took the first group and still needs one
        assert await asyncio.wait_for(blocked, timeout=1.0) == 0
        return gate.outstanding

    assert asyncio.run(scenario()) == 1
