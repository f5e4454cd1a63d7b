"""Async GRPO: rollout workers keep collecting while the trainer steps.

``max_steps_off_policy=N`` turns it on. ``groups_in_flight`` workers each play one group at
a time, stamped with the policy version the generators had when its rollout started, and
queue it when done. A worker starts a group only when the steps that may still admit it
have room for it (``StartGate``): back-pressure instead of rollouts made only to be dropped.
Each step admits finished groups, oldest start version first:

- a group older than N optimizer steps (trainer version − its start version) is dropped as
  stale and counted in ``async/dropped_stale_groups`` — never in ``zero_variance_skip_ratio``;
- other groups are admitted; those without reward variance are skipped and counted;
- a group on its last chance (exactly N steps old) is never overtaken: while such groups are
  still being played, the step waits for them rather than give their places to younger
  groups, which a later step can still take. Otherwise a group with long episodes finishes
  after younger ones took the step and is dropped, its rollouts lost;
- the step trains once it has ``batch_size`` informative groups, or has admitted
  ``max_sampling_attempts × batch_size`` fresh groups (dynamic sampling's budget).

Then it publishes with ``weight_sync_type``: SYNCHRONOUS waits for the generators,
BACKGROUND_PUBLISH and PIPELINE return at once (see ``service/local.py``).

Resume loses and replays nothing: every task position handed to a worker is either done
(trained, skipped or dropped) or not; a checkpoint stores the lowest position not done and
the done positions above it. A resumed run hands out exactly the positions not done, so each
task group of an epoch is trained at most once, and none that was in flight is lost.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from post_training_cookbook.envs.base import Task
from post_training_cookbook.envs.mixture import EnvMixture
from post_training_cookbook.grpo.advantages import (
    build_training_batch,
    is_informative,
)
from post_training_cookbook.grpo.async_workers import (
    PositionLedger,
    RolloutWorkers,
    StampedGroup,
)
from post_training_cookbook.grpo.data import task_stream
from post_training_cookbook.grpo.lockstep import (
    checkpoint_phase,
    distill_phase,
    rollout_metrics,
    train,
    validation_phase,
)
from post_training_cookbook.grpo.runs import Run
from post_training_cookbook.grpo.settings import StepSettings
from post_training_cookbook.rollout import (
    Episode,
    Group,
    check_rollouts_usable,
)
from post_training_cookbook.runs.directory import LoopState


@dataclass
class AsyncAdmission:
    admitted: list[StampedGroup] = field(default_factory=list)
    informative: list[Group] = field(default_factory=list)
    dropped_stale: int = 0
    wait_s: float = 0.0
    ages: list[int] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        groups = [stamped.group for stamped in self.admitted]
        episodes = [episode for group in groups for episode in group.episodes]
        skipped = len(groups) - len(self.informative)
        return {
            "async/train_wait_s": self.wait_s,
            "async/dropped_stale_groups": float(self.dropped_stale),
            "async/policy_age_mean": statistics.fmean(self.ages) if self.ages else 0.0,
            "async/policy_age_max": float(max(self.ages, default=0)),
            "async/off_first_version_token_share": _mixed_version_share(episodes),
            "rollout/groups": float(len(groups)),
            "rollout/zero_variance_skip_ratio": skipped / max(1, len(groups)),
        }


def _mixed_version_share(episodes: Sequence[Episode]) -> float:
    sampled = mixed = 0
    for episode in episodes:
        first = episode.start_version
        for version, mask in zip(episode.versions, episode.mask, strict=True):
            if mask:
                sampled += 1
                mixed += version != first
    return mixed / max(1, sampled)


async def admit_groups(
    workers: RolloutWorkers,
    ledger: PositionLedger,
    steps: StepSettings,
    max_steps_off_policy: int,
    trainer_version: int,
) -> AsyncAdmission:
    """Take finished groups, oldest first, until the batch is full or the dynamic-sampling
    budget is spent."""
    admission = AsyncAdmission()
    budget = steps.max_sampling_attempts * steps.batch_size
    last_chance = trainer_version - max_steps_off_policy
    while len(admission.admitted) < budget:
        still_needed = steps.batch_size - len(admission.informative)
        if still_needed <= 0:
            break
        workers.gate.admitting(trainer_version, still_needed)
        started = time.perf_counter()
        stamped = await workers.next_group(last_chance, still_needed)
        admission.wait_s += time.perf_counter() - started
        workers.gate.taken()
        ledger.mark_done(stamped.position)
        age = trainer_version - stamped.start_version
        if age > max_steps_off_policy:
            admission.dropped_stale += 1
            continue
        admission.admitted.append(stamped)
        admission.ages.append(age)
        if is_informative(stamped.group, steps.advantages):
            admission.informative.append(stamped.group)
    # while this step trains, workers fill the next one, whose trainer version is one higher
    workers.gate.admitting(trainer_version + 1, steps.batch_size)
    return admission


async def run_async(
    run: Run, tasks: Sequence[Task] | EnvMixture, val_tasks: Sequence[Task]
) -> None:
    """Async steps while ``groups_in_flight`` rollout workers keep collecting."""
    steps, schedule, service = run.settings.steps, run.settings.schedule, run.service
    async_settings = run.settings.async_
    assert async_settings is not None
    resumed = run.resumed
    ledger = (
        PositionLedger(resumed.task_cursor, resumed.done_positions) if resumed else PositionLedger()
    )
    stream = task_stream(tasks, steps.seed)
    workers = RolloutWorkers(
        run.episodes, service, stream, ledger, run.train_params, steps, async_settings
    )
    validations = BackgroundValidations(run, val_tasks)
    run.stop.check_before_training(run.start_step)
    workers.start()
    try:
        for step in range(run.start_step, schedule.num_steps):
            metrics: dict[str, float] = {}
            if val_tasks and schedule.validation_due(step):
                metrics |= await validations.start(step)
            started = time.perf_counter()
            idle_before = service.generator_idle_s()
            trainer_version = service.policy_state().trainer_step
            # 1. admit (the workers collect all along)
            admission = await admit_groups(
                workers, ledger, steps, async_settings.max_steps_off_policy, trainer_version
            )
            admitted = time.perf_counter()
            groups = [stamped.group for stamped in admission.admitted]
            limit = run.settings.episodes.max_model_length
            check_rollouts_usable(groups, f"step {step}", limit)
            # 2. score
            batch = build_training_batch(admission.informative, steps.advantages)
            batch, distilled = await distill_phase(run, batch)
            metrics |= distilled
            # 3. train, publish with weight_sync_type
            metrics |= await train(service, batch, steps, step)
            # 4. record
            run.directory.dump_rollouts(step, groups)
            metrics |= rollout_metrics(groups, steps.advantages) | admission.metrics()
            metrics |= validations.finished() | {
                "time/admit": admitted - started,
                "time/step": time.perf_counter() - started,
                "async/generator_idle_s": service.generator_idle_s() - idle_before,
            }
            run.log.record(step, metrics)
            # 5. checkpoint (and stop, saved, when a scheduler asked: the groups in flight
            # are not done, so a resumed run plays them again)
            done_above = sorted(ledger.done_above)
            await checkpoint_phase(run, LoopState(step + 1, ledger.low_water, run.name, done_above))
        await validations.drain()
    finally:
        await workers.stop()
        validations.cancel()


class BackgroundValidations:
    """Validation in async runs. ``sequential_validation``: a blocking phase at one exact
    version (the trainer waits; workers keep collecting under that same version).
    Otherwise validation episodes run beside training, record the version they started at,
    and their metrics join the record of the step during which they finish."""

    def __init__(self, run: Run, val_tasks: Sequence[Task]) -> None:
        self._run = run
        self._val_tasks = val_tasks
        self._pending: tuple[int, asyncio.Task[dict[str, float]]] | None = None

    async def start(self, step: int) -> dict[str, float]:
        """Validate at ``step``: the metrics now when sequential, else once it finishes.
        One still running from an earlier step is awaited first (its metrics returned)."""
        if self._run.settings.validation.sequential:
            return await validation_phase(self._run, self._val_tasks, step)
        earlier = await self._pending[1] if self._pending else {}
        task = asyncio.create_task(validation_phase(self._run, self._val_tasks, step))
        self._pending = (step, task)
        return earlier

    def finished(self) -> dict[str, float]:
        """The metrics of a background validation that finished by now, once."""
        if self._pending is None or not self._pending[1].done():
            return {}
        _, task = self._pending
        self._pending = None
        return task.result()

    async def drain(self) -> None:
        """After the last step: wait for a validation still running and record it under the
        step it started at."""
        if self._pending is not None:
            step, task = self._pending
            self._pending = None
            self._run.log.record(step, await task, advance=False)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()
