"""Tools from an MCP server: ``MCPToolbox`` lists a server's tools once and gives every
episode ``Tool`` objects that call them.

    toolbox = MCPToolbox(MCPStdioServer("python", ("weather_server.py",)))
    env_factory = lambda task: ToolEnv(toolbox.tools(), reward_fn=exact_answer)
    ...
    toolbox.close()

- **Specs**: each tool's spec is the server's own ``tools/list`` entry (name, description,
  ``inputSchema`` as the parameters), read when the toolbox is built; ``tool_names`` keeps
  some of them. A kept name that breaks a tool's name rule, or two tools of one name, are
  refused there (``ValueError``), not when each episode's env is built.
- **Results**: ``tools/call``'s text content is what the model reads (images and resources
  as a one-line note), its ``structuredContent`` rides along as the ``ToolResult``'s
  ``structured_content`` (and is the text, as JSON, when there is no text); ``isError``
  raises ``MCPToolCallError`` with the server's message: a tool error the model reads.
- **Lifetime**: ``lifetime="run"``: one server (one session) shared by every episode, from
  the toolbox's start to its ``close``; started again on the next call if it died.
  ``lifetime="episode"``: each ``tools()`` call gets a server of its own, started on the
  episode's first call and ended by the env's ``close``.
- **Failures**: a server that does not start within ``start_timeout_s``, closes its
  connection, or answers no call within ``call_timeout_s`` raises ``ToolBackendError``: an
  env error under the run's ``env_errors`` (the episode is truncated or played again, or the
  run stops), never a hung episode.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any, Literal

from post_training_cookbook.envs.base import ToolResult
from post_training_cookbook.envs.tools import MAX_ARGUMENTS_LENGTH, TOOL_NAME
from post_training_cookbook.tool_backends.mcp_connection import (
    MCPConnection,
    MCPHttpServer,
    MCPServerSpec,
    MCPStdioServer,
)
from post_training_cookbook.types import ToolSpec

Lifetime = Literal["run", "episode"]


class MCPToolCallError(Exception):
    """The server answered a call with ``isError``: its message, for the model to read."""


class MCPToolbox:
    """One MCP server's tools, for every episode of a run. Building it starts the server and
    lists its tools (``ToolBackendError`` when it cannot), before any model loads."""

    def __init__(
        self,
        server: MCPServerSpec,
        *,
        lifetime: Lifetime = "run",
        tool_names: Sequence[str] | None = None,
        start_timeout_s: float = 30.0,
        call_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(server, MCPStdioServer | MCPHttpServer):
            raise TypeError(f"server must be an MCPStdioServer or MCPHttpServer, got {server!r}")
        if lifetime not in ("run", "episode"):
            raise ValueError(f"lifetime must be 'run' or 'episode', got {lifetime!r}")
        for name, value in (
            ("start_timeout_s", start_timeout_s),
            ("call_timeout_s", call_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.server = server
        self.lifetime = lifetime
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.restarts = 0
        """Times the shared server was started again after it died."""
        self._lock = threading.Lock()
        connection = self._connect()
        try:
            listed = connection.tools_now()
        except BaseException:
            connection.close_now()
            raise
        available = [tool.name for tool in listed]
        if tool_names is not None:
            missing = sorted(set(tool_names) - set(available))
            if missing:
                connection.close_now()
                raise ValueError(f"{connection.label} has no tool {missing}; it has {available}")
            listed = [tool for tool in listed if tool.name in set(tool_names)]
        try:
            check_tool_names([tool.name for tool in listed], connection.label)
        except ValueError:
            connection.close_now()
            raise
        self.specs = [_spec(tool) for tool in listed]
        """The tools' specs, as the server stated them (OpenAI function-tool schema)."""
        self._shared: MCPConnection | None = None
        if lifetime == "run":
            self._shared = connection
        else:
            connection.close_now()

    def _connect(self) -> MCPConnection:
        return MCPConnection(
            self.server, start_timeout_s=self.start_timeout_s, call_timeout_s=self.call_timeout_s
        )

    def tools(self) -> list[MCPTool]:
        """One episode's tools: on the shared server, or (``lifetime="episode"``) on a server
        of the episode's own, started on its first call and ended by ``close``."""
        source: _SharedServer | _EpisodeServer
        source = _SharedServer(self) if self.lifetime == "run" else _EpisodeServer(self)
        return [MCPTool(spec, source) for spec in self.specs]

    def shared_connection(self) -> MCPConnection:
        """The run's server, started again when it died."""
        with self._lock:
            if self._shared is None:
                raise RuntimeError("this MCPToolbox is closed")
            if self._shared.ended is not None:
                self._shared.close_now()
                self._shared = self._connect()
                self.restarts += 1
            return self._shared

    def close(self) -> None:
        """End the shared server (episode servers end with their envs)."""
        with self._lock:
            shared, self._shared = self._shared, None
        if shared is not None:
            shared.close_now()

    def __enter__(self) -> MCPToolbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _SharedServer:
    def __init__(self, toolbox: MCPToolbox) -> None:
        self.toolbox = toolbox

    async def connection(self) -> MCPConnection:
        # in a thread: replacing a dead server closes it, which waits for its thread
        return await asyncio.to_thread(self.toolbox.shared_connection)


class _EpisodeServer:
    def __init__(self, toolbox: MCPToolbox) -> None:
        self.toolbox = toolbox
        self._connection: MCPConnection | None = None

    async def connection(self) -> MCPConnection:
        if self._connection is None:
            self._connection = self.toolbox._connect()
        return self._connection

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


class MCPTool:
    """A ``Tool`` that calls one tool of an MCP server."""

    def __init__(self, spec: ToolSpec, source: _SharedServer | _EpisodeServer) -> None:
        self.spec = spec
        self.name: str = spec["function"]["name"]
        self.description: str = spec["function"]["description"]
        self.parameters_schema: dict[str, Any] = spec["function"]["parameters"]
        self._source = source

    async def execute(self, arguments: str) -> ToolResult:
        values = _arguments(self.name, arguments)
        connection = await self._source.connection()
        result = await connection.call(self.name, values)
        text = result_text(result.content, result.structured_content)
        if result.is_error:
            raise MCPToolCallError(text or f"{self.name} failed")
        return ToolResult(content=text, structured_content=result.structured_content)

    async def close(self) -> None:
        """End the episode's own server (a shared one outlives the episode)."""
        if isinstance(self._source, _EpisodeServer):
            await self._source.close()


def check_tool_names(names: Sequence[str], label: str) -> None:
    """``ValueError`` for a name no env can offer (a function tool's name rule, ``TOOL_NAME``)
    or offered twice: else every episode's env would fail when it is built."""
    for name in names:
        if not TOOL_NAME.match(name):
            raise ValueError(
                f"{label} lists a tool named {name!r:.80}{'...' if len(name) > 80 else ''}: "
                "a tool's name is 1 to 64 letters, digits, '_' or '-'; keep the others with "
                "tool_names"
            )
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{label} lists two tools named {name!r}")
        seen.add(name)


def _spec(tool: Any) -> ToolSpec:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or tool.title or tool.name,
            "parameters": dict(tool.input_schema),
        },
    }


def _arguments(name: str, arguments: str) -> dict[str, Any]:
    """The model's arguments as a JSON object; ``ValueError`` saying what to fix. (The
    server checks them against its schema and answers a mismatch with ``isError``.)"""
    if not isinstance(arguments, str) or len(arguments) > MAX_ARGUMENTS_LENGTH:
        raise ValueError(
            f"{name}: arguments must be a JSON object of at most {MAX_ARGUMENTS_LENGTH} characters"
        )
    try:
        values = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        raise ValueError(f"{name}: arguments are not valid JSON") from None
    if not isinstance(values, dict):
        raise ValueError(f"{name}: arguments must be a JSON object, got {values!r:.80}")
    return values


def result_text(content: Sequence[Any], structured_content: Any) -> str:
    """What the model reads of a call's result: the text blocks, one per line; other blocks
    as a note of what they were; the structured content as JSON when there is no text."""
    parts = []
    for block in content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            resource = block.resource
            parts.append(getattr(resource, "text", None) or f"[resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:  # image, audio
            parts.append(f"[{kind} {getattr(block, 'mime_type', '')}]".replace(" ]", "]"))
    if not parts and structured_content is not None:
        return json.dumps(structured_content, ensure_ascii=False)
    return "\n".join(parts)
