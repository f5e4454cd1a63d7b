"""Stopping a training call when a scheduler asks (SIGTERM): at a step boundary, saved.

Slurm, Kubernetes and most batch schedulers stop a job with SIGTERM, then SIGKILL after a
grace period. Python's default for SIGTERM ends the process at once, and the step in
progress is lost (the run resumes from the checkpoint before it). While a training call
runs (``train_multi_turn``, ``train_single_turn``, ``train_sft``), the first SIGTERM asks
its loop to stop instead: the loop finishes the step it is in, saves a checkpoint of that
step (due on schedule or not), closes the service (generators, engines, trainer) and
raises ``TrainingStopped``, "stopped by SIGTERM after 3 steps (checkpoint .../step_000003);
resume with resume=True to continue". A second SIGTERM goes to the handler that was there
before: by default the process ends at once, as without this. SIGINT (Ctrl-C) keeps its
own behaviour: it cancels the call at once.

The handler is installed only while a training call runs, and the one before is put back
when the call returns, whatever happened. A SIGTERM that came too late for a step boundary
(during the final validation or the final model's save) is handed to that handler once the
call has returned normally, so that the process still stops as asked. Python lets only the
main thread install signal handlers: a training call made in another thread installs none,
and SIGTERM then does what it did before (as it does when the handler in place was set
outside Python, which cannot be put back).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType


class TrainingStopped(Exception):
    """A training call stopped at a step boundary because a signal asked it to; the run
    resumes from ``checkpoint`` (None: it stopped before training a step, from the
    checkpoint it started from) with ``resume=True``."""

    def __init__(self, signal_name: str, completed_steps: int, checkpoint: Path | None) -> None:
        if checkpoint is not None:
            where = f"after {completed_steps} steps (checkpoint {checkpoint})"
        else:
            where = f"before step {completed_steps}, having trained no step"
        super().__init__(f"stopped by {signal_name} {where}; resume with resume=True to continue")
        self.signal_name = signal_name
        self.completed_steps = completed_steps
        self.checkpoint = checkpoint


@dataclass
class StopRequest:
    """Whether a signal asked the training call to stop; the loops read it between steps."""

    signal_name: str | None = None
    """The signal that asked, None while none has."""

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def stopped(self, completed_steps: int, checkpoint: Path | None) -> TrainingStopped:
        return TrainingStopped(self.signal_name or "a signal", completed_steps, checkpoint)

    def check_before_training(self, start_step: int) -> None:
        """Before the loop's first step: a stop asked for while the run loaded ends it now,
        with nothing to save (the run is at the checkpoint it started from)."""
        if self.requested:
            raise self.stopped(start_step, None)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[StopRequest]:
    """While the block runs, the first SIGTERM sets the ``StopRequest`` it yields and the
    second goes to the handler that was in place before; that handler is back afterwards
    (see the module's doc)."""
    request = StopRequest()
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    if previous is None:  # not the main thread, or a handler set outside Python
        yield request
        return

    def ask_to_stop(signum: int, frame: FrameType | None) -> None:
        if request.requested:  # the second: at once, as without this handler
            signal.signal(signal.SIGTERM, previous)
            signal.raise_signal(signal.SIGTERM)
            return
        request.signal_name = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, ask_to_stop)
    returned = False
    try:
        yield request
        returned = True
    finally:
        if signal.getsignal(signal.SIGTERM) is ask_to_stop:
            signal.signal(signal.SIGTERM, previous)
            if returned and request.requested:  # too late for a step boundary: pass it on
                signal.raise_signal(signal.SIGTERM)
