"""Run a coroutine to completion from synchronous code, on one event loop per process.

The library's sync entry points (``train_multi_turn``, ``train_single_turn``, ``evaluate``,
``check_env``) run their coroutines here. They share one event loop, kept between calls,
rather than a new one a call (``asyncio.run``): an async client a user builds once (an
``openai.AsyncOpenAI`` at import, a judge) holds connections that belong to the loop that
first used them, and a second call on a new loop would find them on a closed one ("Event
loop is closed"). Users called two functions; they never asked for event loops.

Each call is otherwise what ``asyncio.run`` gives: Ctrl-C cancels the call's task and lets it
clean up, and tasks the call started and left running are cancelled when it returns. Where
the process loop cannot run the call (this thread already runs a loop, as in a notebook: the
call goes to a worker thread; another thread's call holds it: this one gets a loop of its
own), the call runs as before, on a loop of its own.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

LEFTOVER_GRACE_S = 10.0
"""How long tasks a call left running get to finish their cancellation."""

_runner: asyncio.Runner | None = None
_runner_lock = threading.Lock()
"""Held while a call runs on the process loop: one call at a time."""


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine``'s value, run on the process's event loop (see the module's doc)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _on_process_loop(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_on_process_loop, coroutine).result()


def process_loop() -> asyncio.AbstractEventLoop:
    """The event loop the sync entry points share (created on first use)."""
    return _process_runner().get_loop()


def _process_runner() -> asyncio.Runner:
    global _runner
    if _runner is None:
        _runner = asyncio.Runner()
        atexit.register(_close_process_loop)
    return _runner


def _on_process_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    if not _runner_lock.acquire(blocking=False):  # another thread's call holds it
        return asyncio.run(coroutine)
    try:
        runner = _process_runner()
        loop = runner.get_loop()
        before = asyncio.all_tasks(loop)
        try:
            return runner.run(coroutine)
        finally:
            _cancel_leftovers(loop, asyncio.all_tasks(loop) - before)
    finally:
        _runner_lock.release()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop, tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel the tasks a call started and left running (``asyncio.run`` does as much)."""
    pending = [task for task in tasks if not task.done()]
    if not pending:
        return
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.wait(pending, timeout=LEFTOVER_GRACE_S))


def _close_process_loop() -> None:
    """At exit: end what is left on the loop, without waiting for worker threads that may
    never return (an abandoned tool call)."""
    global _runner
    runner, _runner = _runner, None
    if runner is None:
        return
    loop = runner.get_loop()
    if loop.is_closed() or loop.is_running():
        return
    _cancel_leftovers(loop, asyncio.all_tasks(loop))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
