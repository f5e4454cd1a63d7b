"""GRPO on multi-turn tool-use episodes: ``train_multi_turn`` and ``train_single_turn``.

One lockstep step, top to bottom (``_train_step``):

    1. collect   play ``batch_size`` groups of ``episodes_per_task`` episodes (dynamic
                 sampling: more rounds while groups have no reward variance)
    2. score     shaped rewards → group-relative advantages → training samples
    3. train     forward_backward → optim_step → weights_sync (SYNCHRONOUS)
    4. record    metrics.jsonl, W&B, console, rollout dump; checkpoint on schedule

Where this departs from textbook GRPO, and why:
- Episodes are whole multi-turn conversations, one sample each: every sampled token of the
  episode gets the episode's advantage (tool results and template glue are masked out).
- Groups whose rewards are all equal are skipped and counted, not trained with zero
  advantage (``zero_variance_skip_ratio``).
- The behaviour policy is the sampler's own logprobs (recorded token by token), so the
  loss's importance ratio also covers sampler/trainer numeric differences.
- Validation runs at an exact policy version: between steps, before any training on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.groups import EpisodeRunner, episode_metrics, play_groups
from post_training_cookbook.grpo.advantages import build_training_batch
from post_training_cookbook.grpo.collect import collect_groups
from post_training_cookbook.grpo.config import GRPOConfig, WeightSyncType
from post_training_cookbook.grpo.data import TaskStream
from post_training_cookbook.grpo.reporting import ConsoleProgress, WandbLogger
from post_training_cookbook.grpo.runs import LoopState, RunDirectory
from post_training_cookbook.grpo.session import Session
from post_training_cookbook.models.catalog import (
    ModelInfo,
    require_generator_support,
    resolve_model,
)
from post_training_cookbook.types import Message, ToolSpec

EnvFactory = Callable[[Task], Env]


def train_multi_turn(
    config: GRPOConfig,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    val_tasks: Sequence[Task] | None = None,
) -> RunDirectory:
    """Train ``config.model`` with GRPO on episodes of ``env_factory(task)`` for each task.

    Returns the run directory (``runs/<run_name>``). Bad input fails before any model loads.
    """
    config, info = _checked(config, tasks, env_factory, val_tasks)
    return asyncio.run(_run(config, info, tasks, env_factory, val_tasks or []))


def train_single_turn(
    config: GRPOConfig,
    tasks: Sequence[Task],
    reward_fn: Callable[[str, str], float],
    val_tasks: Sequence[Task] | None = None,
    system_prompt: str | None = None,
) -> RunDirectory:
    """GRPO on one reply per task, scored by ``reward_fn(reply, task.target)`` in [0, 1]."""
    config = replace(config, max_turns=1)
    return train_multi_turn(
        config, tasks, lambda task: SingleTurnEnv(reward_fn, system_prompt), val_tasks
    )


class SingleTurnEnv(Env):
    """The user's prompt, one assistant reply, a reward: single-turn GRPO as an env."""

    def __init__(self, reward_fn: Callable[[str, str], float], system_prompt: str | None) -> None:
        self._reward_fn = reward_fn
        self._system_prompt = system_prompt
        self._messages: list[Message] = []
        self._target = ""

    async def reset(self, task: Task) -> list[Message]:
        self._target = task.target
        system = (
            [Message(role="system", content=self._system_prompt)] if self._system_prompt else []
        )
        self._messages = [*system, Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        reward = float(self._reward_fn(message.get("content") or "", self._target))
        return StepResult(True, False, list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def _checked(
    config: GRPOConfig,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    val_tasks: Sequence[Task] | None,
) -> tuple[GRPOConfig, ModelInfo]:
    """Every check that needs no weights: inputs, the model's catalog entry, limits."""
    if not tasks:
        raise ValueError("tasks is empty: pass at least one Task to train on")
    if not all(isinstance(task, Task) for task in [*tasks, *(val_tasks or [])]):
        raise ValueError("tasks and val_tasks must hold post_training_cookbook.envs.Task objects")
    if not callable(env_factory):
        raise ValueError("env_factory must be a callable that builds a fresh Env for a task")
    if config.is_async:
        raise ValueError(
            "max_steps_off_policy (async training) is not available in this version; "
            "leave it None for lockstep training"
        )
    if config.validation_interval and not val_tasks:
        raise ValueError("validation_interval > 0 needs val_tasks (or set it to 0)")
    info = resolve_model(config.model, codec=config.codec)
    require_generator_support(info)
    if config.max_model_length > info.max_context:
        raise ValueError(
            f"max_model_length={config.max_model_length} exceeds {info.model_id}'s context "
            f"of {info.max_context} tokens"
        )
    return config.with_resolved_run_name(), info


async def _run(
    config: GRPOConfig,
    info: ModelInfo,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    val_tasks: Sequence[Task],
) -> RunDirectory:
    run = RunDirectory(config.run_dir())
    resume = run.last_checkpoint() if config.resume else None
    if run.path.exists() and not config.resume and any(run.path.iterdir()):
        raise ValueError(f"{run.path} already exists: pick another run_name or set resume=True")
    run.create(config)
    wandb = WandbLogger(config, str(run.path), resume=resume is not None)  # fails before loading
    session = await Session.open(config, info, env_factory)
    stream = TaskStream(tasks, config.seed)
    start = 0
    if resume is not None:
        checkpoint, state = resume
        await session.service.load_training_checkpoint(checkpoint)
        start, stream.cursor = state.step, state.task_cursor
        run.truncate_metrics_after(start)
    progress = ConsoleProgress(config.num_steps, start, config.run_name or "")
    try:
        for step in range(start, config.num_steps):
            metrics: dict[str, float] = {}
            if _validation_due(config, step) and val_tasks:
                metrics |= await _validate(session.runner, config, val_tasks, run, step, session)
            metrics |= await _train_step(session, stream, config, run, step)
            _record(run, wandb, progress, step, metrics)
            if _checkpoint_due(config, step + 1):
                await _save_checkpoint(
                    session, run, LoopState(step + 1, stream.cursor, config.run_name or "")
                )
        if val_tasks and config.validation_interval:
            final = await _validate(
                session.runner, config, val_tasks, run, config.num_steps, session
            )
            _record(run, wandb, None, config.num_steps, final)
        await session.service.save_inference_checkpoint(run.final_model_dir)
        progress.note(f"final model: {run.final_model_dir}")
    finally:
        progress.close()
        wandb.finish()
        await session.close()
    return run


async def _train_step(
    session: Session, stream: TaskStream, config: GRPOConfig, run: RunDirectory, step: int
) -> dict[str, float]:
    started = time.perf_counter()
    # 1. collect
    collection = await collect_groups(session.runner, stream, config, session.train_params)
    collected = time.perf_counter()
    # 2. score
    batch = build_training_batch(collection.informative(config)[: config.batch_size], config)
    metrics = episode_metrics(collection.groups) | collection.metrics(config) | batch.metrics()
    # 3. train
    if batch.samples:
        result = await session.service.forward_backward(batch.samples, config.loss_config())
        optim = await session.service.optim_step(config.learning_rate_at(step))
        metrics |= {"loss/loss": result.loss} | result.metrics | optim.metrics
        trained = time.perf_counter()
        await session.service.weights_sync(WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS)
    else:
        trained = time.perf_counter()  # nothing to learn from: no optimizer step
    synced = time.perf_counter()
    # 4. record
    run.dump_rollouts(step, collection.groups)
    sampled_tokens = sum(sum(e.mask) for g in collection.groups for e in g.episodes)
    metrics |= {
        "policy/version": float(session.service.policy_state().trainer_step),
        "time/rollout": collected - started,
        "time/train": trained - collected,
        "time/weight_sync": synced - trained,
        "time/step": synced - started,
        "throughput/sampled_tokens_per_s": sampled_tokens / max(1e-9, collected - started),
    }
    return metrics


async def _validate(
    runner: EpisodeRunner,
    config: GRPOConfig,
    val_tasks: Sequence[Task],
    run: RunDirectory,
    step: int,
    session: Session,
) -> dict[str, float]:
    """Validation at the current policy version (nothing trains while it runs)."""
    started = time.perf_counter()
    groups = await play_groups(runner, val_tasks, config.val_episodes_per_task, session.val_params)
    run.dump_rollouts(step, groups, kind="val")
    metrics = episode_metrics(groups, prefix="val/")
    metrics["val/policy_version"] = float(session.service.policy_state().applied_weights_version)
    metrics["time/validation"] = time.perf_counter() - started
    return metrics


def _validation_due(config: GRPOConfig, step: int) -> bool:
    return config.validation_interval > 0 and step % config.validation_interval == 0


def _checkpoint_due(config: GRPOConfig, completed_steps: int) -> bool:
    return (
        config.checkpoint_interval > 0 and completed_steps % config.checkpoint_interval == 0
    ) or completed_steps == config.num_steps


async def _save_checkpoint(session: Session, run: RunDirectory, state: LoopState) -> None:
    folder = run.checkpoint_dir(state.step)
    await session.service.save_training_checkpoint(folder)
    run.write_loop_state(folder, state)


def _record(
    run: RunDirectory,
    wandb: WandbLogger,
    progress: ConsoleProgress | None,
    step: int,
    metrics: dict[str, float],
) -> None:
    run.append_metrics({"step": step, **metrics})
    wandb.log(metrics, step=step)
    if progress is not None:
        progress.update(metrics)
