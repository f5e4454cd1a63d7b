"""Where a function tool's call runs, so that a call that never returns can be left behind.

- A sync function runs in a daemon thread of its own, not in the event loop's shared pool:
  when the env step's timeout cancels the call, the thread is abandoned. It holds no pool
  slot that other calls wait for, and neither the loop's shutdown nor the interpreter's exit
  waits for it. A Python thread cannot be killed, though: an abandoned call keeps running (and
  holding what it holds) until it returns, or until the process ends.
- ``function_tool(isolated=True)`` runs each call in a child process of its own (``spawn``),
  killed when the call is cancelled or runs past the tool's ``timeout_s``: the one way to stop
  a function that may never return. The function must be importable by its module and name,
  and its arguments and result picklable.

Whatever a function raises that is not an ``Exception`` (``SystemExit``,
``KeyboardInterrupt``, ``GeneratorExit``, a ``BaseException`` subclass, or an asyncio
``CancelledError`` the run did not ask for) becomes ``ToolCrashed``, an ``Exception`` the env
reports to the model like any other tool error: the run's own cancellation is the only one
that passes through.

What the call returned becomes the text the model reads by ``as_tool_result``, in the child
process too (so that what crosses back is a ``ToolResult``, not whatever the function returned).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import inspect
import json
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from post_training_cookbook.envs.base import ToolResult

T = TypeVar("T")
log = logging.getLogger(__name__)

_abandoned_lock = threading.Lock()
_abandoned: set[threading.Thread] = set()


class ToolCrashed(Exception):
    """A tool raised a ``BaseException`` that is not an ``Exception`` (or a stray
    ``CancelledError``); the message names it, so the model reads it as a tool error."""


def is_run_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is the cancellation of the task that runs the call (the step timeout,
    the run stopping), which must pass through; any other ``CancelledError`` is the tool's."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def crashed(name: str, exc: BaseException) -> ToolCrashed:
    return ToolCrashed(f"{name} raised {type(exc).__name__}({str(exc)[:200]!r})")


def abandoned_threads() -> int:
    """How many abandoned sync tool calls are still running (they cannot be killed)."""
    with _abandoned_lock:
        _abandoned.difference_update([t for t in _abandoned if not t.is_alive()])
        return len(_abandoned)


async def in_daemon_thread(call: Callable[[], T], name: str) -> T:
    """``call()`` in a daemon thread of its own; a cancellation abandons the thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def deliver(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def body() -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = context.run(call)
        except Exception as exc:
            error = exc
        except BaseException as exc:  # a tool's SystemExit is the tool's
            error = crashed(name, exc)
        # the loop may have closed while the call ran: then nobody waits for it
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, value, error)

    thread = threading.Thread(target=body, name=f"function_tool {name}", daemon=True)
    thread.start()
    try:
        return await future
    except asyncio.CancelledError:
        if thread.is_alive():
            with _abandoned_lock:
                _abandoned.add(thread)
            log.warning(
                "function tool %s did not return before its call was cancelled; its thread is "
                "left behind (a Python thread cannot be killed: function_tool(isolated=True) "
                "runs a call in a process that can be)",
                name,
            )
        raise


# ---------------------------------------------------------------- process-isolated calls


def importable_reference(fn: Callable[..., Any]) -> tuple[str, str]:
    """(module, qualified name) by which a child process finds ``fn``, or ``TypeError``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise TypeError(
            f"function_tool(isolated=True) needs a function importable by module and name, "
            f"got {qualname or fn!r} of module {module!r}: define it at the top of a module"
        )
    return module, qualname


async def in_child_process(
    reference: tuple[str, str], values: dict[str, Any], name: str, timeout_s: float | None
) -> Any:
    """The function's result (as a ``ToolResult``) run in a fresh child process, which is
    killed when the call is cancelled or runs past ``timeout_s``."""
    context = multiprocessing.get_context("spawn")
    receiving, sending = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main, args=(*reference, values, sending), name=f"function_tool {name}"
    )
    process.daemon = True
    process.start()
    sending.close()
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(receiving.fileno(), readable.set)
    try:
        try:
            await asyncio.wait_for(readable.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{name} ran past its timeout_s={timeout_s:g}; killed") from None
        try:
            ok, payload = receiving.recv()
        except (EOFError, OSError):
            process.join(5.0)
            raise ToolCrashed(f"{name}'s process died (exit code {process.exitcode})") from None
    finally:
        loop.remove_reader(receiving.fileno())
        receiving.close()
        if process.is_alive():
            process.kill()
        process.join(5.0)
    if not ok:
        raise ToolCrashed(payload)
    return payload


def _child_main(module: str, qualname: str, values: dict[str, Any], sending: Any) -> None:
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        result = target(**values)  # a function, or the ``FunctionTool`` made of it: it calls it
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        message: tuple[bool, Any] = (True, as_tool_result(result, qualname))
    except BaseException as exc:  # reported to the parent, whatever it is
        message = (False, f"{qualname} raised {type(exc).__name__}({str(exc)[:200]!r})")
    sending.send(message)
    sending.close()


def as_tool_result(value: Any, name: str = "the tool") -> ToolResult:
    """What a function returned, as the text the model reads: strings as they are, ``None``
    as empty, JSON values as JSON, anything else by ``str``. ``TypeError`` for a
    ``ToolResult`` whose content is not a string and for a generator (its ``repr`` would be
    no answer)."""
    if isinstance(value, ToolResult):
        if not isinstance(value.content, str):
            raise TypeError(
                f"{name} returned ToolResult(content=<{type(value.content).__name__}>): "
                "content must be a string"
            )
        return value
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        raise TypeError(f"{name} returned a generator: return the text (or a JSON value)")
    if isinstance(value, str):
        return ToolResult(content=value)
    if value is None:
        return ToolResult(content="")
    try:
        return ToolResult(content=json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        return ToolResult(content=str(value))
