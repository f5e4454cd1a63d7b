"""MCP servers that misbehave where the SDK's own server would not (``tests/mcp_raw_server.py``):
an ordinary JSON-RPC error -32000 to a call is a tool error, not a lost connection; a server
stuck in its start that ignores SIGTERM is killed when its connection closes, however long
the close takes; duplicate or invalid tool names are refused when the toolbox is built; a
server writing garbage lines is logged a few times, without tracebacks."""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from test_mcp_tools import processes_with, wait_until_gone

from post_training_cookbook.envs import ToolBackendError
from post_training_cookbook.tool_backends import mcp_connection
from post_training_cookbook.tool_backends.mcp_connection import MCPConnection, MCPStdioServer
from post_training_cookbook.tool_backends.mcp_tools import MCPToolbox

SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


def raw_server(mode: str, marker: str = "") -> MCPStdioServer:
    return MCPStdioServer(sys.executable, (str(SERVER), mode, *([marker] if marker else [])))


def test_a_json_rpc_error_minus_32000_to_a_call_is_a_tool_error_not_a_lost_connection() -> None:
    with MCPToolbox(raw_server("errors")) as toolbox:
        echo, busy = toolbox.tools()
        with pytest.raises(ValueError, match="busy: Connection closed"):
            asyncio.run(busy.execute('{"text": "x"}'))
        assert toolbox.shared_connection().ended is None
        assert asyncio.run(echo.execute('{"text": "still here"}')).content == "still here"
        assert toolbox.restarts == 0


def test_a_server_stuck_in_its_start_is_killed_however_long_its_close_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A close past its bound (as under load): the SDK's own ending of the process (stdin
    closed, SIGTERM, SIGKILL after 4 s) is cut short, and the connection kills what it
    started itself."""
    monkeypatch.setattr(mcp_connection, "CLOSE_TIMEOUT_S", 0.3)
    marker = f"ptc-{uuid.uuid4().hex[:12]}"
    connection = MCPConnection(raw_server("no_init", marker), start_timeout_s=0.5,
                               call_timeout_s=1.0)  # fmt: skip
    with pytest.raises(ToolBackendError, match=r"did not start within 0\.5 s"):
        connection.tools_now()
    assert wait_until_gone(marker, within_s=1.0), f"left running: {processes_with(marker)}"


@pytest.mark.parametrize(
    ("mode", "says"),
    [("duplicate", "two tools named 'echo'"), ("bad_names", "'two words'")],
)
def test_duplicate_or_invalid_tool_names_are_refused_when_the_toolbox_is_built(
    mode: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        MCPToolbox(raw_server(mode))


def test_a_server_that_writes_garbage_is_logged_a_few_times_without_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING), MCPToolbox(raw_server("garbage")) as toolbox:
        (echo,) = toolbox.tools()
        for _ in range(3):
            assert asyncio.run(echo.execute('{"text": "ok"}')).content == "ok"
    about = [r for r in caplog.records if r.name.startswith("mcp")]
    assert 1 <= len(about) <= 3, [r.getMessage() for r in about]
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in about)
    assert "more lines that are not JSON-RPC" in about[-1].getMessage() or len(about) == 1
