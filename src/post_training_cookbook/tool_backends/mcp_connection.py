"""``MCPConnection``: one session with one MCP server, through the official ``mcp`` SDK.

The SDK's ``Client`` is an async context manager whose task group must be entered and left by
one task, and it runs on anyio; an episode's env lives in the rollout's event loop, a shared
server outlives every episode, and a server that hangs must not stall the loop. So each
connection runs on an event loop of its own, in a thread of its own: the session is held
open by one task there (``_serve``), and callers in any loop hand their requests over
(``run_coroutine_threadsafe``) and wait for the answers with their own timeouts. A request
that gets no answer in time is abandoned (and cancelled in the connection's loop), never
awaited for ever.

What goes wrong with the server (it did not start in time, its connection closed, it did
not answer) raises ``ToolBackendError``: the env lets it through, and the rollout makes it
an env error under ``env_errors``. An error about the call itself (the server rejected the
arguments, or answered any JSON-RPC error) raises ``ValueError``: the model reads it as a
tool error. The SDK reports a closed connection with the code -32000, which a server may
also answer with: a -32000 is taken for a lost connection only when the SDK refuses a
``tools/list`` (sent past its cache) the same way: it refuses every request once the
connection is closed.

A stdio server is started with ``POST_TRAINING_COOKBOOK_MCP_SERVER`` set to a mark of its
connection, and every close ends with SIGKILL to each process still carrying it (Linux:
read from ``/proc``): the SDK ends the server's process group itself, but a close cut
short (a server stuck in its start, ignoring SIGTERM, on a loaded machine) or a child that
left the group would otherwise outlive the run.

The SDK logs a traceback for each line a stdio server writes that is not JSON-RPC; that
log is cut to its first line, once a minute, with a count of the lines since.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from post_training_cookbook.envs.base import ToolBackendError
from post_training_cookbook.tool_backends.process_marks import kill_marked, new_mark

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSE_TIMEOUT_S = 10.0
"""How long closing a connection may take (the SDK ends a stdio server's process, waiting a
moment for it to exit before it kills it); past it the connection's task is cancelled."""
MAX_TOOL_PAGES = 100
"""Pages of ``tools/list`` read at most: a server that paginates for ever cannot hang a start."""
PROBE_TIMEOUT_S = 5.0
"""How long the request that tells a server's -32000 from a closed connection may take."""
MARK_VARIABLE = "POST_TRAINING_COOKBOOK_MCP_SERVER"
"""In a stdio server's environment: its connection's mark, which its processes inherit."""
GARBAGE_LOG_INTERVAL_S = 60.0
"""The SDK's log of a line that is not JSON-RPC passes once in this long, counted."""


@dataclass(frozen=True)
class MCPStdioServer:
    """An MCP server this process starts and talks to over its stdin and stdout."""

    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables on top of the SDK's few defaults (``HOME``, ``PATH``, ...); the training
    process's own environment is not passed on."""
    cwd: str | None = None

    def describe(self) -> str:
        return " ".join([os.path.basename(self.command), *self.args])[:120]


@dataclass(frozen=True)
class MCPHttpServer:
    """An MCP server already running, reached over streamable HTTP at ``url``."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    """Sent with every request (an ``Authorization`` header, say)."""

    def describe(self) -> str:
        return self.url


MCPServerSpec = MCPStdioServer | MCPHttpServer


class MCPConnection:
    """A started (or starting) session with one server; it begins starting when built."""

    def __init__(
        self, server: MCPServerSpec, *, start_timeout_s: float, call_timeout_s: float
    ) -> None:
        self.server = server
        self.label = f"MCP server {server.describe()!r}"
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.ended: str | None = None
        """Why the connection ended, once it has (None while it is usable)."""
        self._mark = new_mark()
        _quiet_garbage_log()
        self._client: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self._started: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._closing = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="mcp-connection", daemon=True)
        self._thread.start()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        """Hold the session open until ``close``; the one task that enters and leaves it."""
        from mcp import Client

        self._serve_task = asyncio.current_task()
        try:
            async with Client(self._target(), read_timeout_seconds=self.call_timeout_s) as client:
                tools = await _all_tools(client)
                self._client = client
                _settle(self._started, result=tools)
                await self._closing.wait()
        except BaseException as exc:
            self._end(f"{self.label} ended: {_reason(exc)}")
            _settle(self._started, error=exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._client = None
            self._end(f"{self.label} was closed")

    def _target(self) -> Any:
        from mcp import StdioServerParameters

        if isinstance(self.server, MCPStdioServer):
            return StdioServerParameters(
                command=self.server.command,
                args=list(self.server.args),
                env={**self.server.env, MARK_VARIABLE: self._mark},
                cwd=self.server.cwd,
            )
        if not self.server.headers:
            return self.server.url
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        http = httpx2.AsyncClient(
            headers=dict(self.server.headers), timeout=httpx2.Timeout(30.0, read=300.0)
        )
        return streamable_http_client(self.server.url, http_client=http)

    def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why

    # ---------------------------------------------------------------- from any event loop

    async def tools(self) -> list[Any]:
        """The server's tools (``mcp.types.Tool``, as ``tools/list`` stated them), once it has
        started; ``ToolBackendError`` when it did not start within ``start_timeout_s``."""
        done = await _wait(self._started, self.start_timeout_s)
        if not done:
            self._end(f"{self.label} did not start within {self.start_timeout_s:g} s")
            await self.close()
            raise ToolBackendError(self.ended)
        try:
            return self._started.result()
        except Exception as exc:
            raise ToolBackendError(f"{self.label} could not start: {_reason(exc)}") from exc

    def tools_now(self) -> list[Any]:
        """``tools`` for synchronous code (blocks up to ``start_timeout_s``)."""
        try:
            return self._started.result(self.start_timeout_s)
        except concurrent.futures.TimeoutError:
            self._end(f"{self.label} did not start within {self.start_timeout_s:g} s")
            self.close_now()
            raise ToolBackendError(self.ended) from None
        except Exception as exc:
            raise ToolBackendError(f"{self.label} could not start: {_reason(exc)}") from exc

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """``tools/call``: the server's ``CallToolResult``."""
        await self.tools()
        if self.ended is not None:
            raise ToolBackendError(self.ended)
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        request = self._submit(
            self._client.call_tool(name, arguments, read_timeout_seconds=self.call_timeout_s)
        )
        # a second past the SDK's own read timeout, which answers first when it can
        if not await _wait(request, self.call_timeout_s + 1.0):
            request.cancel()
            raise ToolBackendError(self._no_answer(name))
        try:
            return request.result()
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise ToolBackendError(self._no_answer(name)) from exc
            if exc.code == CONNECTION_CLOSED and await self._connection_lost():
                self._end(f"{self.label}: its connection closed during tools/call {name!r}")
                raise ToolBackendError(self.ended) from exc
            # an error about this call (unknown tool, invalid arguments, the server's own)
            raise ValueError(f"{name}: {exc.message}") from exc
        except (TimeoutError, concurrent.futures.CancelledError) as exc:
            raise ToolBackendError(self._no_answer(name)) from exc
        except Exception as exc:  # the transport failed: a refused connection, a reset
            self._end(f"{self.label} failed during tools/call {name!r}: {_reason(exc)}")
            raise ToolBackendError(self.ended) from exc

    async def _connection_lost(self) -> bool:
        """Whether the connection is closed, as the SDK tells it: every request after the
        close fails with ``CONNECTION_CLOSED`` (or the transport's error) at once; a live
        server answers ``tools/list`` (``ping`` is deprecated by the protocol)."""
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED

        client = self._client
        if client is None:
            return True
        probe = self._submit(client.list_tools(cache_mode="bypass"))
        if not await _wait(probe, PROBE_TIMEOUT_S):
            probe.cancel()
            return True
        try:
            probe.result()
        except MCPError as exc:
            return exc.code == CONNECTION_CLOSED
        except Exception:  # the transport failed: the connection is gone
            return True
        return False

    def _no_answer(self, name: str) -> str:
        return f"{self.label} gave no answer to tools/call {name!r} in {self.call_timeout_s:g} s"

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def close(self) -> None:
        """End the session (and a stdio server's process); idempotent."""
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        """``close`` for synchronous code; waits at most ``CLOSE_TIMEOUT_S``."""
        if not self._loop.is_closed() and self._loop.is_running():
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self._submit(self._shutdown()).result(CLOSE_TIMEOUT_S + 1.0)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        self._end(f"{self.label} was closed")
        if isinstance(self.server, MCPStdioServer):
            left = kill_marked(MARK_VARIABLE, self._mark)
            if left.killed or left.survived:
                log.warning("%s: killed the process(es) it left %s; could not kill %s",
                            self.label, list(left.killed), list(left.survived))  # fmt: skip

    async def _shutdown(self) -> None:
        """Leave the session: at once, by cancelling, while it is still starting (a server
        that never answers the handshake); otherwise let ``_serve`` leave it, which ends a
        stdio server's process, and cancel it if that takes past ``CLOSE_TIMEOUT_S``."""
        self._closing.set()
        task = self._serve_task
        if task is None:  # closed before it began: it will see `_closing` set
            return
        if not self._started.done():
            task.cancel()
        _, pending = await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
        if pending:
            log.warning("%s did not close within %g s; cancelled", self.label, CLOSE_TIMEOUT_S)
            task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)


async def _all_tools(client: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    for _ in range(MAX_TOOL_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


async def _wait(future: concurrent.futures.Future[Any], timeout_s: float) -> bool:
    """Whether ``future`` (of another thread) finished within ``timeout_s``; it is left
    running otherwise (``asyncio.wait`` cancels nothing). Its outcome is read from ``future``
    itself, so the asyncio copy's is marked as read here."""
    copy = asyncio.wrap_future(future)
    copy.add_done_callback(lambda done: done.cancelled() or done.exception())
    finished, _ = await asyncio.wait([copy], timeout=timeout_s)
    return bool(finished)


def _settle(
    future: concurrent.futures.Future[Any],
    *,
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    if future.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _reason(exc: BaseException) -> str:
    """What went wrong, from an exception that may be a group of them (anyio's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]


class _GarbageLogLimit(logging.Filter):
    """The SDK's "Failed to parse JSONRPC message" (a traceback a line a server writes that
    is not JSON-RPC): its first line only, once in ``GARBAGE_LOG_INTERVAL_S``, counted."""

    message = "Failed to parse JSONRPC message from server"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.message:
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._last < GARBAGE_LOG_INTERVAL_S:
                self._suppressed += 1
                return False
            self._last, suppressed, self._suppressed = now, self._suppressed, 0
        error = record.exc_info[1] if record.exc_info else None
        said = str(error).splitlines()[0][:200] if error is not None and str(error) else ""
        record.msg = f"{self.message}{f': {said}' if said else ''}" + (
            f" ({suppressed} more lines that are not JSON-RPC since)" if suppressed else ""
        )
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        record.args = ()
        return True


_GARBAGE_LOG_LIMIT = _GarbageLogLimit()


def _quiet_garbage_log() -> None:
    stdio_log = logging.getLogger("mcp.client.stdio")
    if _GARBAGE_LOG_LIMIT not in stdio_log.filters:
        stdio_log.addFilter(_GARBAGE_LOG_LIMIT)
