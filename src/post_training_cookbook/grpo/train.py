"""Train with GRPO (``train_multi_turn``, ``train_single_turn``): a run from the call to the
final model.

1. Checks that need no weights: the tasks and env factory, the model's catalog entry and
   context, the packages the service needs. Bad input fails before anything loads.
2. ``open_run``: the codec and the model service; a resumed run loads its newest readable
   checkpoint; only then the run directory (config.yaml) and W&B. A start or resume that
   fails leaves the run folder as it was. Whatever fails later, what was opened is closed.
3. The loop: ``lockstep.run_lockstep``, or ``async_loop.run_async`` when
   ``max_steps_off_policy`` is set. A scheduler's SIGTERM stops it after the step it is in,
   saved (``runs/stopping.py``); a full disk while it saves, with ``DiskFullError``
   (``runs/saving.py``).
4. The final validation and the final model (``runs/<run_name>/final_model``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from post_training_cookbook.distill.teacher import check_same_tokenizer, open_teacher
from post_training_cookbook.distill.types import Teacher
from post_training_cookbook.envs.base import EnvFactory, Task
from post_training_cookbook.envs.mixture import EnvMixture
from post_training_cookbook.envs.single_turn import SingleTurnEnv
from post_training_cookbook.grpo.async_loop import run_async
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.lockstep import run_lockstep, validation_phase
from post_training_cookbook.grpo.runs import Run, RunDirectory
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.models.availability import check_router_replay, require_weights
from post_training_cookbook.models.catalog import (
    check_model_can_sample,
    require_engine_support,
    resolve_model,
)
from post_training_cookbook.models.loading import load_codec, load_tokenizer
from post_training_cookbook.rollout import EpisodeRunner, EpisodesInFlight, check_episode_inputs
from post_training_cookbook.runs.opening import claim_run_folder, open_run_folder
from post_training_cookbook.runs.saving import save_final_model
from post_training_cookbook.runs.stopping import StopRequest, stop_on_sigterm
from post_training_cookbook.service.base import ModelService
from post_training_cookbook.service.factory import check_service_spec, open_service
from post_training_cookbook.sync import run_sync


def train_multi_turn(
    config: GRPOConfig,
    tasks: Sequence[Task] | EnvMixture,
    env_factory: EnvFactory | None = None,
    val_tasks: Sequence[Task] | None = None,
) -> RunDirectory:
    """Train ``config.model`` with GRPO on episodes of ``env_factory(task)`` for each task.

    ``tasks`` may be an ``EnvMixture`` instead, which brings its envs' factories, weights and
    validation tasks: then leave ``env_factory`` and ``val_tasks`` out. Returns the run
    directory (``runs/<run_name>``). Bad input fails before any model loads. Without
    validation tasks the run does not validate (and says so once). Callable from sync code,
    also inside a running event loop (a notebook). A SIGTERM while it trains stops the run
    after the step it is in, saved, with ``TrainingStopped`` (``runs/stopping.py``).
    """
    factory, val = _episode_inputs(tasks, env_factory, val_tasks)
    config, settings = _checked(config, tasks, factory, val)
    with stop_on_sigterm() as stop:
        return run_sync(_train(config, settings, tasks, factory, val, stop))


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


def _episode_inputs(
    tasks: Sequence[Task] | EnvMixture,
    env_factory: EnvFactory | None,
    val_tasks: Sequence[Task] | None,
) -> tuple[EnvFactory, list[Task]]:
    """The env factory and the validation tasks: the caller's, or a mixture's own."""
    if not isinstance(tasks, EnvMixture):
        if env_factory is None:
            raise ValueError("env_factory must be a callable that builds a fresh Env for a task")
        return env_factory, list(val_tasks or [])
    if env_factory is not None or val_tasks is not None:
        raise ValueError(
            "an EnvMixture brings its own env factories and validation tasks: leave "
            "env_factory and val_tasks out (each MixtureEntry has val_tasks)"
        )
    return tasks.env_factory, tasks.val_tasks


def _checked(
    config: GRPOConfig,
    tasks: Sequence[Task] | EnvMixture,
    env_factory: EnvFactory,
    val_tasks: Sequence[Task],
) -> tuple[GRPOConfig, RunSettings]:
    """Every check that needs no weights; the config with its run name fixed, and its
    settings per layer."""
    train_tasks = tasks.tasks if isinstance(tasks, EnvMixture) else tasks
    check_episode_inputs(train_tasks, env_factory, purpose="train", val_tasks=val_tasks)
    info = resolve_model(config.model, codec=config.codec)
    check_model_can_sample(info, config.max_model_length)
    weights = require_weights(info)  # first: on a machine without them, nothing else matters
    config = config.with_resolved_run_name()
    settings = RunSettings.from_config(config, info)  # checks the codec options too
    require_engine_support(info, settings.service.generation_engine)
    check_service_spec(settings.service)
    if config.router_replay:
        check_router_replay(info.model_id, weights)
    if settings.teacher is not None and not settings.teacher.is_endpoint:
        check_same_tokenizer(info, settings.teacher.source, GRPOConfig)  # before any weights load
    return config, settings


async def _train(
    config: GRPOConfig,
    settings: RunSettings,
    tasks: Sequence[Task] | EnvMixture,
    env_factory: EnvFactory,
    val_tasks: Sequence[Task],
    stop: StopRequest,
) -> RunDirectory:
    validation_interval = settings.schedule.validation_interval
    async with open_run(config, settings, env_factory, stop=stop) as run:
        if validation_interval and not val_tasks:
            run.log.note(
                f"validation is off: validation_interval={validation_interval} needs val_tasks"
            )
        loop = run_async if settings.async_ is not None else run_lockstep
        await loop(run, tasks, val_tasks)
        if val_tasks and validation_interval:
            end = settings.schedule.num_steps
            run.log.record(end, await validation_phase(run, val_tasks, end), advance=False)
        await save_final_model(run.directory, run.service)
        run.log.note(f"final model: {run.directory.final_model_dir}")
    return run.directory


@contextlib.asynccontextmanager
async def open_run(
    config: GRPOConfig,
    settings: RunSettings,
    env_factory: EnvFactory,
    service: ModelService | None = None,
    stop: StopRequest | None = None,
) -> AsyncIterator[Run]:
    """The run's codec and service (resumed from the newest readable checkpoint with
    ``resume``), directory and W&B; on the way out, whatever happened, each is closed in
    reverse order. The folder is claimed before anything loads and written only once
    everything has (``runs/opening.py``).

    ``service``: run on a service the caller built (and closes), instead of opening one
    from ``settings.service``. ``stop``: what tells the loop a scheduler asked it to stop
    (``stop_on_sigterm``'s); none by default."""
    directory = claim_run_folder(RunDirectory, config)
    async with contextlib.AsyncExitStack() as opened:
        # After an error (the generators are closed by then): wait for the episodes still in
        # flight, so that each closes its env. Their sampling fails at once; an env call still
        # running gets its timeout twice (step, then close), or 60 s without one.
        in_flight = EpisodesInFlight()
        opened.push_async_callback(
            in_flight.let_finish, 2 * (settings.episodes.env_step_timeout_s or 30.0)
        )
        model = settings.service.model
        codec = load_codec(model, load_tokenizer(model), settings.codec_options)
        if service is None:
            service = await open_service(settings.service)
            opened.push_async_callback(service.close)
        teacher: Teacher | None = None
        if settings.teacher is not None:
            teacher = await open_teacher(settings.teacher, model.model_id, GRPOConfig)
            opened.push_async_callback(teacher.close)
        # Loaded: only now does anything in the run folder change, and W&B start.
        log, resumed = await open_run_folder(
            opened, directory, config, service, settings.schedule.num_steps
        )
        stops = codec.stop_token_ids
        yield Run(
            name=config.resolved_run_name(),
            settings=settings,
            service=service,
            episodes=EpisodeRunner(env_factory, service, codec, settings.episodes, in_flight),
            train_params=replace(settings.train_sampling, stop_token_ids=stops),
            val_params=replace(settings.val_sampling, stop_token_ids=stops),
            directory=directory,
            log=log,
            resumed=resumed,
            teacher=teacher,
            stop=stop or StopRequest(),
        )
