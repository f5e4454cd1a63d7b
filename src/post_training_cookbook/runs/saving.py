"""Saving a run's checkpoints and final model, as every loop does, and a full disk.

A checkpoint is written whole under a temporary name and renamed when complete
(``runs/directory.py``), so a save that fails leaves the checkpoints before it as they were.
When it fails because the disk is full (no space left, or the quota spent), the unfinished
save is removed, freeing what it took, and the run stops with ``DiskFullError``: the
folder it was writing, the space left there, and the newest checkpoint a resume will
continue from. The error is recognised however it reaches the loop: an ``OSError``
(ENOSPC, EDQUOT), safetensors' own error (its writer reports "No space left on device (os
error 28)" as a ``SafetensorError``), or either from a Ray actor.

``checkpoint_step`` is the end of every loop's step: a checkpoint on schedule, and one
before stopping when a scheduler asked (``runs/stopping.py``).
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from post_training_cookbook.files import PARTIAL_SUFFIX, commit_folder, partial_folder
from post_training_cookbook.runs.directory import LoopState, RunDirectory
from post_training_cookbook.runs.stopping import StopRequest
from post_training_cookbook.service.base import ModelService

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "(os error 28)")
"""How a full disk reads where only a message carries it (safetensors' Rust writer, Ray)."""


class DiskFullError(OSError):
    """A run's save failed because the device it writes to is full; ``target``: the folder
    it was writing (its unfinished save removed), ``free_bytes``: the space left there."""

    def __init__(self, target: Path, free_bytes: int | None, what_is_kept: str) -> None:
        free = "free space unknown" if free_bytes is None else f"{_size_text(free_bytes)} free"
        message = (
            f"no space left on device while writing {target} ({free} there now); its "
            f"unfinished save was removed, {what_is_kept}. Free space, then run again with "
            "resume=True"
        )
        super().__init__(errno.ENOSPC, message, str(target))
        self.target = target
        self.free_bytes = free_bytes

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, says the disk is full."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(seen) for text in DISK_FULL_TEXTS):
            return True
        seen = seen.__cause__
    return False


async def checkpoint_step(
    directory: RunDirectory,
    service: ModelService,
    state: LoopState,
    *,
    due: bool,
    stop: StopRequest,
) -> None:
    """The end of a step: a checkpoint when ``due`` on schedule or when a signal asked the
    run to stop, and then ``TrainingStopped``. A signal that comes during a checkpoint due
    on schedule stops the run at once too: that checkpoint is of this step."""
    if not (due or stop.requested):
        return
    checkpoint = await save_checkpoint(directory, service, state)
    if stop.requested:
        raise stop.stopped(state.step, checkpoint)


async def save_checkpoint(directory: RunDirectory, service: ModelService, state: LoopState) -> Path:
    """The trainer's files, then the loop's state, under a temporary name; the folder is
    renamed to its step's once complete and durable, so a kill leaves no half checkpoint.
    The rename is here, not in the trainer, which may be a Ray actor on another machine."""
    target = directory.checkpoint_dir(state.step)
    with _named_if_disk_full(directory, target, kept=_checkpoints_kept):
        partial = directory.partial_checkpoint(state.step)
        await service.save_training_checkpoint(partial)
        directory.commit_checkpoint(partial, state)
    return target


async def save_final_model(directory: RunDirectory, service: ModelService) -> Path:
    """``final_model/``, written whole under a temporary name and renamed when complete."""
    target = directory.final_model_dir
    with _named_if_disk_full(directory, target, kept=_final_model_kept):
        partial = partial_folder(target)
        await service.save_inference_checkpoint(partial)
        commit_folder(partial, target)
    return target


@contextlib.contextmanager
def _named_if_disk_full(
    directory: RunDirectory, target: Path, kept: Callable[[RunDirectory], str]
) -> Iterator[None]:
    """Turn a full disk while ``target`` is written into ``DiskFullError``, once the
    unfinished save is removed; ``kept``: what the run still has, for the message."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        shutil.rmtree(target.with_name(target.name + PARTIAL_SUFFIX), ignore_errors=True)
        raise DiskFullError(target, _free_bytes(directory.path), kept(directory)) from error


def _checkpoints_kept(directory: RunDirectory) -> str:
    earlier = directory.checkpoints()
    if not earlier:
        return "and no checkpoint was saved before it: a resume starts over"
    return f"the checkpoints saved before it are untouched (the newest: {earlier[0].name})"


def _final_model_kept(directory: RunDirectory) -> str:
    return "every checkpoint is untouched, and a resume from the last writes the final model"


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _size_text(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"
