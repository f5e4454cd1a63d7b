"""The pieces of a step that lockstep (``train.py``) and async (``async_train.py``) share:
score and train on groups, validate, record, checkpoint."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from post_training_cookbook.envs.base import Task
from post_training_cookbook.groups import Group, episode_metrics, play_groups
from post_training_cookbook.grpo.advantages import build_training_batch
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.reporting import ConsoleProgress, WandbLogger
from post_training_cookbook.grpo.runs import LoopState, RunDirectory
from post_training_cookbook.grpo.session import Session
from post_training_cookbook.rollout import derive_seed


@dataclass
class RunContext:
    """What every step of a run reads or writes."""

    session: Session
    config: GRPOConfig
    run: RunDirectory
    wandb: WandbLogger
    progress: ConsoleProgress
    started: float
    """``time.perf_counter()`` when training started (for ``time/elapsed``)."""
    background_validation: asyncio.Task[dict[str, float]] | None = None
    """Async mode without ``sequential_validation``: validation running beside training."""

    def record(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        metrics = {**metrics, "time/elapsed": time.perf_counter() - self.started}
        self.run.append_metrics({"step": step, **metrics})
        self.wandb.log(metrics, step=step)
        if advance:
            self.progress.update(metrics)


async def train_on_groups(
    ctx: RunContext, informative: Sequence[Group], step: int
) -> dict[str, float]:
    """Phases 2-3: advantages and samples, then forward_backward → optim_step → weights_sync.
    A step with nothing to learn from makes no optimizer step."""
    config, service = ctx.config, ctx.session.service
    started = time.perf_counter()
    batch = build_training_batch(informative[: config.batch_size], config)
    metrics = batch.metrics()
    trained = synced = started
    if batch.samples:
        result = await service.forward_backward(batch.samples, config.loss_config())
        optim = await service.optim_step(config.learning_rate_at(step))
        metrics |= {"loss/loss": result.loss} | result.metrics | optim.metrics
        trained = time.perf_counter()
        await service.weights_sync(config.weight_sync_type)
        synced = time.perf_counter()
    state = service.policy_state()
    return metrics | {
        "policy/version": float(state.trainer_step),
        "policy/applied_version": float(state.applied_weights_version),
        "time/train": trained - started,
        "time/weight_sync": synced - trained,
    }


async def validate(ctx: RunContext, val_tasks: Sequence[Task], step: int) -> dict[str, float]:
    """Validation episodes at the current policy version; waits for a deferred publish to
    land first, so that every episode samples with one version."""
    session, config = ctx.session, ctx.config
    while session.service.policy_state().pending_publish:
        await asyncio.sleep(0.01)
    version = session.service.policy_state().applied_weights_version
    started = time.perf_counter()
    seeds = [derive_seed(config.seed, "val", index) for index in range(len(val_tasks))]
    groups = await play_groups(
        session.runner, val_tasks, config.val_episodes_per_task, session.val_params, seeds
    )
    ctx.run.dump_rollouts(step, groups, kind="val")
    return episode_metrics(groups, prefix="val/") | {
        "val/policy_version": float(version),
        "time/validation": time.perf_counter() - started,
    }


def validation_due(config: GRPOConfig, step: int) -> bool:
    return config.validation_interval > 0 and step % config.validation_interval == 0


def checkpoint_due(config: GRPOConfig, completed_steps: int) -> bool:
    interval = config.checkpoint_interval
    return (interval > 0 and completed_steps % interval == 0) or completed_steps == config.num_steps


async def save_checkpoint(ctx: RunContext, state: LoopState) -> None:
    folder = ctx.run.checkpoint_dir(state.step)
    await ctx.session.service.save_training_checkpoint(folder)
    ctx.run.write_loop_state(folder, state)


def dump_and_describe(ctx: RunContext, step: int, groups: Sequence[Group]) -> dict[str, float]:
    """Write the step's rollout dump; return its episode metrics."""
    ctx.run.dump_rollouts(step, groups)
    return episode_metrics(groups)
