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
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.grpo.async_train import run_async_steps
from post_training_cookbook.grpo.collect import collect_groups
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.data import TaskStream
from post_training_cookbook.grpo.reporting import ConsoleProgress, WandbLogger
from post_training_cookbook.grpo.runs import LoopState, RunDirectory
from post_training_cookbook.grpo.session import Session
from post_training_cookbook.grpo.steps import (
    RunContext,
    checkpoint_due,
    dump_and_describe,
    save_checkpoint,
    train_on_groups,
    validate,
    validation_due,
)
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
    if config.validation_interval and not val_tasks:
        raise ValueError("validation_interval > 0 needs val_tasks (or set it to 0)")
    if config.backend == "ray":
        from post_training_cookbook.service.ray import check_scale_dependencies

        check_scale_dependencies(config.generation_engine)
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
    # Whatever fails from here on, what was opened is closed (engines, W&B, the console).
    async with contextlib.AsyncExitStack() as opened:
        wandb = WandbLogger(config, str(run.path), resume=config.resume)  # before loading
        opened.push(lambda error_type, *_: wandb.finish(failed=error_type is not None))
        opened.push_async_callback(_let_episodes_end, config.env_step_timeout_s)
        session = await Session.open(config, info, env_factory)
        opened.push_async_callback(session.close)
        start = 0
        if resume is not None:
            checkpoint, state = resume
            await session.service.load_training_checkpoint(checkpoint)
            start = state.step
        if config.resume:  # also without a finished checkpoint: then the run starts over
            run.drop_metrics_from(start)
        progress = opened.enter_context(
            ConsoleProgress(config.num_steps, start, config.run_name or "")
        )
        ctx = RunContext(session, config, run, wandb, progress, time.perf_counter())
        steps = run_async_steps if config.is_async else run_lockstep_steps
        await steps(ctx, tasks, val_tasks, start, resume[1] if resume else None)
        if val_tasks and config.validation_interval:
            ctx.record(
                config.num_steps, await validate(ctx, val_tasks, config.num_steps), advance=False
            )
        await session.service.save_inference_checkpoint(run.final_model_dir)
        progress.note(f"final model: {run.final_model_dir}")
    return run


async def _let_episodes_end(env_timeout_s: float | None) -> None:
    """After an error (the generators are closed by now): wait for the episodes still in
    flight, so that each closes its env. Left to ``asyncio.run``, they would be cancelled,
    which can cut an env's ``close()`` short. Their sampling fails at once; an env call still
    running gets its timeout (twice: ``step``, then ``close``), or 60 s without one."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=2 * (env_timeout_s or 30.0))


async def run_lockstep_steps(
    ctx: RunContext,
    tasks: Sequence[Task],
    val_tasks: Sequence[Task],
    start: int,
    resumed: LoopState | None,
) -> None:
    """Lockstep: rollouts finish before training starts; every step is on-policy."""
    config = ctx.config
    stream = TaskStream(tasks, config.seed, cursor=resumed.task_cursor if resumed else 0)
    for step in range(start, config.num_steps):
        metrics: dict[str, float] = {}
        if validation_due(config, step) and val_tasks:
            metrics |= await validate(ctx, val_tasks, step)
        metrics |= await _lockstep_step(ctx, stream, step)
        ctx.record(step, metrics)
        if checkpoint_due(config, step + 1):
            await save_checkpoint(ctx, LoopState(step + 1, stream.cursor, config.run_name or ""))


async def _lockstep_step(ctx: RunContext, stream: TaskStream, step: int) -> dict[str, float]:
    config, session = ctx.config, ctx.session
    started = time.perf_counter()
    # 1. collect
    collection = await collect_groups(session.runner, stream, config, session.train_params)
    collected = time.perf_counter()
    # 2-3. score, train, publish
    metrics = await train_on_groups(ctx, collection.informative(config), step)
    # 4. record
    metrics |= dump_and_describe(ctx, step, collection.groups) | collection.metrics(config)
    sampled_tokens = sum(sum(e.mask) for g in collection.groups for e in g.episodes)
    return metrics | {
        "time/rollout": collected - started,
        "time/step": time.perf_counter() - started,
        "throughput/sampled_tokens_per_s": sampled_tokens / max(1e-9, collected - started),
    }
