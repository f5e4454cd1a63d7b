"""Lockstep GRPO, one step top to bottom, and the phase functions the async loop reuses.

    1. collect     play ``batch_size`` groups of ``episodes_per_task`` episodes; dynamic
                   sampling plays more rounds while too few groups are informative
    2. score       shaped rewards → group-relative advantages → training samples
    3. train       forward_backward → optim_step → weights_sync (SYNCHRONOUS in lockstep)
                   What 2 and 3 optimise, advantages to loss, is ``trainer/objective.py``.
    4. record      the step's rollout dump; metrics.jsonl, W&B, console
    5. checkpoint  on schedule, with the task cursor, so a resumed run sees the same tasks;
                   and when a scheduler asked the run to stop (SIGTERM): then it stops here

Where this departs from textbook GRPO, and why:
- Episodes are whole multi-turn conversations, one sample each: every sampled token of the
  episode gets the episode's advantage (tool results and template glue are masked out).
- Groups whose (shaped) rewards are all equal are skipped and counted, not trained with zero
  advantage (``rollout/zero_variance_skip_ratio``).
- The behaviour policy is the sampler's own logprobs (recorded token by token), so the
  loss's importance ratio also covers sampler/trainer numeric differences.
- Validation runs at an exact policy version: between steps, before any training on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from post_training_cookbook.distill.advantages import distill_batch
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Task
from post_training_cookbook.envs.mixture import EnvMixture
from post_training_cookbook.grpo.advantages import (
    AdvantageSettings,
    TrainingBatch,
    build_training_batch,
    is_informative,
)
from post_training_cookbook.grpo.data import TaskSource, task_stream
from post_training_cookbook.grpo.runs import Run
from post_training_cookbook.grpo.settings import StepSettings, ValidationSettings
from post_training_cookbook.grpo.turn_metrics import per_turn_metrics
from post_training_cookbook.rollout import (
    EpisodeRunner,
    Group,
    check_rollouts_usable,
    derive_seed,
    episode_metrics,
    per_env_metrics,
    play_groups,
)
from post_training_cookbook.runs.directory import LoopState
from post_training_cookbook.runs.reporting import training_metrics
from post_training_cookbook.runs.saving import checkpoint_step
from post_training_cookbook.service.base import ModelService


async def run_lockstep(
    run: Run, tasks: Sequence[Task] | EnvMixture, val_tasks: Sequence[Task]
) -> None:
    """Lockstep: each step's rollouts finish before it trains, so every step is on-policy."""
    steps, schedule = run.settings.steps, run.settings.schedule
    max_model_length = run.settings.episodes.max_model_length
    cursor = run.resumed.task_cursor if run.resumed else 0
    stream = task_stream(tasks, steps.seed, cursor=cursor)
    run.stop.check_before_training(run.start_step)
    for step in range(run.start_step, schedule.num_steps):
        metrics: dict[str, float] = {}
        if val_tasks and schedule.validation_due(step):
            metrics |= await validation_phase(run, val_tasks, step)
        started = time.perf_counter()
        # 1. collect
        collected = await collect_groups(run.episodes, stream, steps, run.train_params)
        collect_s = time.perf_counter() - started
        check_rollouts_usable(collected.groups, f"step {step}", max_model_length)
        # 2. score
        batch = build_training_batch(collected.informative[: steps.batch_size], steps.advantages)
        batch, distilled = await distill_phase(run, batch)
        metrics |= distilled
        # 3. train
        metrics |= await train(run.service, batch, steps, step)
        # 4. record
        run.directory.dump_rollouts(step, collected.groups)
        metrics |= rollout_metrics(collected.groups, steps.advantages)
        metrics |= collected.metrics() | {
            "time/rollout": collect_s,
            "time/step": time.perf_counter() - started,
            "throughput/sampled_tokens_per_s": collected.sampled_tokens / max(1e-9, collect_s),
        }
        run.log.record(step, metrics)
        # 5. checkpoint (and stop, saved, when a scheduler asked)
        await checkpoint_phase(run, LoopState(step + 1, stream.cursor, run.name))


# ---------------------------------------------------------------- the phases


@dataclass
class CollectedGroups:
    """The groups one step played, informative or not, in the order they were played."""

    groups: list[Group] = field(default_factory=list)
    informative: list[Group] = field(default_factory=list)
    attempts: int = 0

    @property
    def sampled_tokens(self) -> int:
        return sum(e.num_sampled_tokens for group in self.groups for e in group.episodes)

    def metrics(self) -> dict[str, float]:
        skipped = len(self.groups) - len(self.informative)
        return {
            "rollout/sampling_attempts": float(self.attempts),
            "rollout/groups": float(len(self.groups)),
            "rollout/zero_variance_skip_ratio": skipped / max(1, len(self.groups)),
        }


async def collect_groups(
    episodes: EpisodeRunner, stream: TaskSource, steps: StepSettings, params: SamplingParams
) -> CollectedGroups:
    """Phase 1 with dynamic sampling: each of up to ``max_sampling_attempts`` rounds plays as
    many new tasks as the batch still lacks informative groups."""
    collected = CollectedGroups()
    while collected.attempts < steps.max_sampling_attempts:
        missing = steps.batch_size - len(collected.informative)
        if missing <= 0:
            break
        collected.attempts += 1
        taken = stream.take(missing)
        seeds = [derive_seed(steps.seed, "train", position) for position, _ in taken]
        tasks = [task for _, task in taken]
        groups = await play_groups(episodes, tasks, steps.episodes_per_task, params, seeds)
        collected.groups += groups
        collected.informative += [
            group for group in groups if is_informative(group, steps.advantages)
        ]
    return collected


async def distill_phase(run: Run, batch: TrainingBatch) -> tuple[TrainingBatch, dict[str, float]]:
    """Phase 2b, with a teacher: its per-token advantages added to the batch's."""
    distill = run.settings.steps.distill
    if run.teacher is None or distill is None:
        return batch, {}
    samples, metrics = await distill_batch(batch.samples, run.teacher, run.service, distill)
    return replace(batch, samples=samples), metrics


async def train(
    service: ModelService, batch: TrainingBatch, steps: StepSettings, step: int
) -> dict[str, float]:
    """Phase 3: forward_backward → optim_step → weights_sync. A batch with nothing to learn
    from makes no optimizer step."""
    started = time.perf_counter()
    metrics = batch.metrics()
    trained = synced = started
    if batch.samples:
        result = await service.forward_backward(batch.samples, steps.loss)
        optim = await service.optim_step(steps.learning_rate.at(step))
        metrics |= {"loss/loss": result.loss} | training_metrics(result, optim)
        trained = time.perf_counter()
        await service.weights_sync(steps.weight_sync_type)
        synced = time.perf_counter()
    state = service.policy_state()
    return metrics | {
        "policy/version": float(state.trainer_step),
        "policy/applied_version": float(state.applied_weights_version),
        "time/train": trained - started,
        "time/weight_sync": synced - trained,
    }


def rollout_metrics(groups: Sequence[Group], settings: AdvantageSettings) -> dict[str, float]:
    """The step's episode metrics, reward variance judged on the shaped reward; the same
    per env of a mixture (``rollout/<env>/…``), and per turn index (``rollout/turn_<k>/…``)."""
    reward_of = settings.shaping.shaped_reward
    return (
        episode_metrics(groups, reward_of=reward_of)
        | per_env_metrics(groups, "rollout/", reward_of)
        | per_turn_metrics(groups, settings)
    )


async def validate(
    episodes: EpisodeRunner,
    service: ModelService,
    tasks: Sequence[Task],
    params: SamplingParams,
    settings: ValidationSettings,
) -> tuple[list[Group], dict[str, float]]:
    """Validation episodes at the current policy version; waits for a deferred publish to
    land first, so that every episode samples with one version."""
    while service.policy_state().pending_publish:
        await asyncio.sleep(0.01)
    version = service.policy_state().applied_weights_version
    started = time.perf_counter()
    seeds = [derive_seed(settings.seed, "val", index) for index in range(len(tasks))]
    groups = await play_groups(episodes, tasks, settings.episodes_per_task, params, seeds)
    reward_of = settings.shaping.shaped_reward
    metrics = episode_metrics(groups, "val/", reward_of) | per_env_metrics(
        groups, "val/", reward_of
    )
    return groups, metrics | {
        "val/policy_version": float(version),
        "time/validation": time.perf_counter() - started,
    }


async def validation_phase(run: Run, val_tasks: Sequence[Task], step: int) -> dict[str, float]:
    """Validate, and dump the validation episodes as ``rollouts/val_step_<step>.jsonl``."""
    groups, metrics = await validate(
        run.episodes, run.service, val_tasks, run.val_params, run.settings.validation
    )
    run.directory.dump_rollouts(step, groups, kind="val")
    limit = run.settings.episodes.max_model_length
    check_rollouts_usable(groups, f"the validation before step {step}", limit)
    return metrics


async def checkpoint_phase(run: Run, state: LoopState) -> None:
    """Phase 5: a checkpoint when one is due, or when a signal asked the run to stop: then
    ``TrainingStopped`` once it is saved (``runs/saving.py``)."""
    due = run.settings.schedule.checkpoint_due(state.step)
    await checkpoint_step(run.directory, run.service, state, due=due, stop=run.stop)
