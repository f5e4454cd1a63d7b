"""How long a coroutine runs without yielding to its event loop, and a watchdog that names one
that stays blocked.

A coroutine that blocks its loop (``time.sleep`` inside ``async def``) cannot be interrupted:
no timeout fires while the loop is blocked. ``Stretches`` drives a coroutine step by step and
keeps the longest step, so a caller can judge the call once it returns; ``BlockWatch`` names
it while it is still blocked. The rollout guards every env call with them
(``rollout/guards.py``); ``check_env`` reports an env's longest stretch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class RaisedBaseException(Exception):
    """The coroutine raised ``SystemExit``, ``KeyboardInterrupt`` or ``GeneratorExit``: its
    own error, not the end of the run (asyncio would stop the event loop on them), so it is
    handed on as an ordinary exception."""


class Stretches(Coroutine[Any, Any, Any]):
    """A coroutine, driven step by step, that keeps the longest stretch it ran without
    yielding to the event loop. It is a coroutine itself, so a task runs it directly: no
    frame stands between the task and the coroutine it times."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], label: str) -> None:
        self._coroutine = coroutine
        self._label = label
        self.longest_s = 0.0
        self.abandoned = False
        """Set when the call ignored its cancellation: the next exception thrown in closes
        the coroutine instead of handing it over."""

    def send(self, value: Any) -> Any:
        started = time.perf_counter()
        watch.enter(self._label, started)
        try:
            return self._coroutine.send(value)  # its StopIteration ends this coroutine too
        except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
            raise RaisedBaseException(f"raised {type(exc).__name__}({exc})") from None
        finally:
            watch.leave()
            self.longest_s = max(self.longest_s, time.perf_counter() - started)

    def throw(self, kind: Any, value: Any = None, trace: Any = None) -> Any:
        """Hand an exception (a cancellation included) to the coroutine; one that ignored its
        cancellation before is closed instead."""
        error = value if value is not None else kind if isinstance(kind, BaseException) else kind()
        if self.abandoned:
            with contextlib.suppress(RuntimeError):  # it ignored GeneratorExit too
                self._coroutine.close()
            raise error
        started = time.perf_counter()
        watch.enter(self._label, started)
        try:
            return self._coroutine.throw(error)
        except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
            raise RaisedBaseException(f"raised {type(exc).__name__}({exc})") from None
        finally:
            watch.leave()
            self.longest_s = max(self.longest_s, time.perf_counter() - started)

    def close(self) -> None:
        self._coroutine.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        return self  # send/throw/close, and __next__ below

    def __iter__(self) -> Stretches:
        return self

    def __next__(self) -> Any:
        return self.send(None)


async def with_longest_stretch(awaitable: Awaitable[T]) -> tuple[T, float]:
    """The awaitable's value, and the longest it ran without yielding (``check_env`` reports it)."""
    stretches = Stretches(as_coroutine(awaitable), "call")
    value: T = await stretches
    return value, stretches.longest_s


def as_coroutine(awaitable: Awaitable[T]) -> Coroutine[Any, Any, T]:
    if asyncio.iscoroutine(awaitable):
        return awaitable

    async def awaited() -> T:
        return await awaitable

    return awaited()


class BlockWatch:
    """Names an env call that has blocked its event loop's thread for a while, as it
    happens (the call itself can only be judged once it returns). One daemon thread, started
    on first use; each thread's current env stretch is a tuple read atomically."""

    def __init__(self, report_after_s: float = 10.0) -> None:
        self.report_after_s = report_after_s
        self._current: dict[int, tuple[str, float]] = {}
        self._reported: set[tuple[int, float]] = set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def enter(self, label: str, started: float) -> None:
        self._current[threading.get_ident()] = (label, started)
        if self._thread is None:
            self._start()

    def leave(self) -> None:
        self._current.pop(threading.get_ident(), None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="BlockWatch", daemon=True)
                self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.report_after_s / 2))
            now = time.perf_counter()
            for ident, (label, started) in list(self._current.items()):
                if now - started > self.report_after_s and (ident, started) not in self._reported:
                    self._reported.add((ident, started))
                    log.warning(
                        "%s has blocked the event loop for %.0fs: every episode waits for it",
                        label,
                        now - started,
                    )


watch = BlockWatch()
