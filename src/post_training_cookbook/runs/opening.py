"""Opening a run folder, as every loop does (``grpo/train.py``, ``sft/train.py``), in two
moves: ``claim_run_folder`` before anything loads (a start or resume that cannot go ahead
fails with the folder as it was), ``open_run_folder`` once everything has (the newest
readable checkpoint into the service, config.yaml, W&B and the console's progress)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol, TypeVar

from post_training_cookbook.runs.directory import (
    LoopState,
    RunConfig,
    RunDirectory,
    resume_from_checkpoint,
)
from post_training_cookbook.runs.reporting import ConsoleProgress, RunLog, WandbLogger
from post_training_cookbook.service.base import ModelService


class OpenedConfig(RunConfig, Protocol):
    """What opening a run folder reads of a loop's config (its run name already fixed)."""

    @property
    def wandb_project(self) -> str | None: ...

    def resolved_run_name(self) -> str: ...

    def run_dir(self) -> Path: ...

    def to_dict(self) -> dict[str, Any]: ...


Directory = TypeVar("Directory", bound=RunDirectory)


def claim_run_folder(directory_type: type[Directory], config: OpenedConfig) -> Directory:
    """The run's folder (the loop's ``RunDirectory`` class), before anything loads: a folder
    with files is refused unless the config resumes it, and a resumed config is checked
    against the run's config.yaml (``RunDirectory.check_resumable``)."""
    directory = directory_type(config.run_dir())
    if directory.path.exists() and not config.resume and any(directory.path.iterdir()):
        raise ValueError(
            f"{directory.path} already exists: pick another run_name or set resume=True"
        )
    if config.resume:
        directory.check_resumable(config)
    return directory


async def open_run_folder(
    opened: contextlib.AsyncExitStack,
    directory: RunDirectory,
    config: OpenedConfig,
    service: ModelService,
    num_steps: int,
) -> tuple[RunLog, LoopState | None]:
    """Once the run has loaded: with ``resume``, the newest checkpoint that reads back into
    ``service`` (None: the run starts over); then, and only then, the folder made the run's
    (``RunDirectory.start``: config.yaml), W&B (as the hosted guide says: a run without a W&B
    setup fails after it provisions the model) and the console's progress over
    ``num_steps``, both closed by ``opened``. The run's log, told what the resume found."""
    resumed: LoopState | None = None
    notes: list[str] = []
    if config.resume:
        resumed, notes = await resume_from_checkpoint(directory, service)
    notes += directory.start(config, resumed)
    name = config.resolved_run_name()
    wandb = WandbLogger(
        config.wandb_project, name, str(directory.path), config.to_dict(), resume=config.resume
    )
    opened.push(lambda error_type, *_: wandb.finish(failed=error_type is not None))
    start = resumed.step if resumed else 0
    progress = opened.enter_context(ConsoleProgress(num_steps, start, name))
    log = RunLog(directory, wandb, progress)
    for note in notes:
        log.note(note)
    return log, resumed
