"""Tools from MCP servers, against a real server this test starts (``tests/mcp_server.py``,
written with the official SDK) over stdio and over streamable HTTP on loopback: the tool
list, calls, tool errors, a server killed mid-episode, a server that never answers, and GRPO
runs of a ``ToolEnv`` whose tools come from MCP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from post_training_cookbook.envs import ToolBackendError, ToolEnv, exact_answer
from post_training_cookbook.envs.base import Task
from post_training_cookbook.tool_backends.mcp_connection import (
    MCPHttpServer,
    MCPServerSpec,
    MCPStdioServer,
)
from post_training_cookbook.tool_backends.mcp_tools import MCPToolbox, MCPToolCallError
from post_training_cookbook.types import Message

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "mcp_server.py"
SERVER_ENV = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


def stdio_server(call_log: Path) -> MCPStdioServer:
    return MCPStdioServer(
        sys.executable,
        (str(SERVER), "stdio"),
        env={**SERVER_ENV, "MCP_TEST_CALL_LOG": str(call_log)},
    )


class HttpServer:
    """``tests/mcp_server.py http PORT`` as a subprocess, on 127.0.0.1."""

    def __init__(self, call_log: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), "http", str(self.port)],
            env={**os.environ, **SERVER_ENV, "MCP_TEST_CALL_LOG": str(call_log)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.spec = MCPHttpServer(f"http://127.0.0.1:{self.port}/mcp")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the HTTP test server exited"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the HTTP test server did not listen within 60 s")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    server = HttpServer(tmp_path_factory.mktemp("mcp_http") / "calls.jsonl")
    yield server
    server.stop()


@pytest.fixture(params=["stdio", "http"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> MCPServerSpec:
    if request.param == "stdio":
        return stdio_server(tmp_path / "calls.jsonl")
    return request.getfixturevalue("http_server").spec


def calls_logged(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tool_call(name: str, **arguments: object) -> Message:
    return Message(
        role="assistant",
        content="",
        tool_calls=[
            {
                "id": f"call_{name}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    )


def listed_by_the_sdk(spec: MCPServerSpec) -> list[dict[str, object]]:
    """The server's tools/list, read with the SDK's own client, independently of ours."""
    from mcp import Client, StdioServerParameters

    async def listing() -> list[dict[str, object]]:
        target: object = spec.url if isinstance(spec, MCPHttpServer) else None
        if isinstance(spec, MCPStdioServer):
            target = StdioServerParameters(
                command=spec.command, args=list(spec.args), env=dict(spec.env)
            )
        async with Client(target) as client:  # type: ignore[arg-type]
            page = await client.list_tools()
            return [
                {"name": t.name, "description": t.description, "parameters": t.input_schema}
                for t in page.tools
            ]

    return run(listing())


# ---------------------------------------------------------------- listing and calls


def test_the_tool_specs_are_the_servers_own_listing(server: MCPServerSpec) -> None:
    with MCPToolbox(server) as toolbox:
        env = ToolEnv(toolbox.tools(), reward_fn=exact_answer)
        assert env.tool_specs == toolbox.specs
        assert [spec["function"] for spec in toolbox.specs] == listed_by_the_sdk(server)
        names = [spec["function"]["name"] for spec in toolbox.specs]
        assert names == ["list_fact_keys", "lookup", "calculator", "add", "fail", "hang", "die"]
    with MCPToolbox(server, tool_names=["lookup", "add"]) as toolbox:
        assert [spec["function"]["name"] for spec in toolbox.specs] == ["lookup", "add"]
    with pytest.raises(ValueError, match=r"has no tool \['nope'\]"):
        MCPToolbox(server, tool_names=["nope"])


def test_an_http_server_is_reached_with_the_headers_given(http_server: HttpServer) -> None:
    spec = MCPHttpServer(http_server.spec.url, headers={"Authorization": "Bearer test"})
    with MCPToolbox(spec, tool_names=["add"]) as toolbox:
        (add,) = toolbox.tools()
        assert run(add.execute('{"a": 3, "b": 4}')).structured_content["total"] == 7


def test_a_call_gives_the_text_and_the_structured_content(server: MCPServerSpec) -> None:
    with MCPToolbox(server) as toolbox:
        tools = {tool.name: tool for tool in toolbox.tools()}
        result = run(tools["add"].execute('{"a": 2, "b": 40}'))
        assert result.structured_content == {"total": 42, "terms": [2, 40]}
        assert json.loads(result.content) == {"total": 42, "terms": [2, 40]}
        assert run(tools["lookup"].execute('{"key": "kalo.weight"}')).content.strip() != ""

        env = ToolEnv(list(tools.values()), reward_fn=exact_answer)

        async def episode() -> list[Message]:
            await env.reset(Task(prompt="What is 2 + 40?", target="42"))
            await env.step(tool_call("calculator", expression="2 + 40"))
            result = await env.step(Message(role="assistant", content="42"))
            assert result.reward == 1.0
            return result.messages

        assert [m["content"] for m in run(episode()) if m["role"] == "tool"] == ["42"]


def test_an_is_error_result_is_a_tool_error_the_model_reads(server: MCPServerSpec) -> None:
    with MCPToolbox(server) as toolbox:
        tools = toolbox.tools()
        with pytest.raises(MCPToolCallError, match="failed on purpose: because"):
            run(next(t for t in tools if t.name == "fail").execute('{"reason": "because"}'))
        env = ToolEnv(tools, reward_fn=exact_answer)

        async def episode() -> tuple[list[Message], dict[str, float]]:
            await env.reset(Task(prompt="Fail, then answer.", target="ok"))
            await env.step(tool_call("fail", reason="asked to"))
            await env.step(tool_call("lookup", key=7))  # the server's schema check
            result = await env.step(Message(role="assistant", content="ok"))
            return result.messages, result.metrics

        messages, metrics = run(episode())
        replies = [m["content"] for m in messages if m["role"] == "tool"]
        assert replies[0] == "tool_error: Error executing tool fail: failed on purpose: asked to"
        assert replies[1].startswith("tool_error: ") and "valid string" in replies[1]
        assert metrics["num_tool_errors"] == 2.0


# ---------------------------------------------------------------- servers that fail


def test_a_call_the_server_never_answers_is_an_env_error_at_the_timeout(
    server: MCPServerSpec,
) -> None:
    with MCPToolbox(server, call_timeout_s=1.0) as toolbox:
        env = ToolEnv(toolbox.tools(), reward_fn=exact_answer)

        async def episode() -> None:
            await env.reset(Task(prompt="Wait.", target=""))
            await env.step(tool_call("hang"))

        with pytest.raises(ToolBackendError, match=r"gave no answer to tools/call 'hang' in 1 s"):
            run(episode())
        # the connection itself still works
        assert run(toolbox.tools()[3].execute('{"a": 1, "b": 1}')).structured_content["total"] == 2


def test_a_server_that_never_answers_its_start_is_refused_at_the_start_timeout(
    tmp_path: Path,
) -> None:
    marker = f"ptc-{uuid.uuid4().hex[:12]}"
    silent = MCPStdioServer(sys.executable, ("-c", f"import time; time.sleep(600)  # {marker}"))
    with pytest.raises(ToolBackendError, match=r"did not start within 1\.5 s"):
        MCPToolbox(silent, start_timeout_s=1.5)
    assert wait_until_gone(marker)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nothing_there = MCPHttpServer(f"http://127.0.0.1:{probe.getsockname()[1]}/mcp")
    with pytest.raises(ToolBackendError, match="could not start"):
        MCPToolbox(nothing_there, start_timeout_s=10)


def wait_until_gone(marker: str, within_s: float = 15.0) -> bool:
    """Whether no process's command line holds ``marker`` within ``within_s`` (ending a
    process takes the SDK a moment: it asks, then kills)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not processes_with(marker):
            return True
        time.sleep(0.1)
    return False


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_stdio_server_killed_mid_episode_is_an_env_error_and_a_shared_one_restarts(
    tmp_path: Path,
) -> None:
    log = tmp_path / "calls.jsonl"
    with MCPToolbox(stdio_server(log)) as toolbox:
        env = ToolEnv(toolbox.tools(), reward_fn=exact_answer)

        async def episode() -> None:
            await env.reset(Task(prompt="Add twice.", target="2"))
            await env.step(tool_call("add", a=1, b=1))
            (first_pid,) = {call["pid"] for call in calls_logged(log)}
            os.kill(int(first_pid), signal.SIGKILL)  # type: ignore[call-overload]
            await env.step(tool_call("add", a=1, b=1))

        with pytest.raises(ToolBackendError, match="connection closed during tools/call 'add'"):
            run(episode())
        # the next episode's call starts the run's server again
        later = ToolEnv(toolbox.tools(), reward_fn=exact_answer)
        result = run(later.tools["add"].execute('{"a": 2, "b": 2}'))
        assert result.structured_content["total"] == 4 and toolbox.restarts == 1
        assert len({call["pid"] for call in calls_logged(log)}) == 2


def test_an_http_server_killed_mid_episode_is_an_env_error(tmp_path: Path) -> None:
    server = HttpServer(tmp_path / "calls.jsonl")
    try:
        with MCPToolbox(server.spec, call_timeout_s=10) as toolbox:
            env = ToolEnv(toolbox.tools(), reward_fn=exact_answer)

            async def episode() -> None:
                await env.reset(Task(prompt="Add twice.", target="2"))
                await env.step(tool_call("add", a=1, b=1))
                server.stop()
                await env.step(tool_call("add", a=1, b=1))

            with pytest.raises(ToolBackendError, match=f"'{server.spec.url}'"):
                run(episode())
    finally:
        server.stop()


def test_an_episode_server_starts_on_the_first_call_and_ends_with_the_env(
    tmp_path: Path,
) -> None:
    log = tmp_path / "calls.jsonl"
    toolbox = MCPToolbox(stdio_server(log), lifetime="episode")
    envs = [ToolEnv(toolbox.tools(), reward_fn=exact_answer) for _ in range(2)]

    async def two_episodes() -> None:
        for env in envs:
            await env.reset(Task(prompt="Add.", target="2"))
        await asyncio.gather(*(env.step(tool_call("add", a=1, b=1)) for env in envs))

    run(two_episodes())
    pids = {int(call["pid"]) for call in calls_logged(log)}  # type: ignore[call-overload]
    assert len(pids) == 2  # a server per episode
    run(envs[0].close())
    run(envs[1].close())
    assert not any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in pids)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_bad_toolbox_settings_are_refused() -> None:
    with pytest.raises(TypeError, match="MCPStdioServer or MCPHttpServer"):
        MCPToolbox("python server.py")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lifetime must be 'run' or 'episode'"):
        MCPToolbox(MCPStdioServer("python"), lifetime="step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="call_timeout_s must be > 0"):
        MCPToolbox(MCPStdioServer("python"), call_timeout_s=0)
