"""The code sandbox: what model-written code run by the ``python`` and ``bash`` tools cannot
do (reach the network, read the host, write outside its scratch folder, outlive its run),
the limits that end it with a clear tool error, and 32 runs at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from post_training_cookbook.envs import Task, ToolEnv, exact_answer
from post_training_cookbook.tool_backends.sandbox import (
    SandboxConfig,
    SandboxPool,
    SandboxRunError,
    SandboxSession,
    SandboxUnavailableError,
    code_tools,
)
from post_training_cookbook.tool_backends.sandbox.seccomp import socket_filter
from post_training_cookbook.types import Message

PROJECT = Path(__file__).resolve().parents[1]
# a wall-clock timeout far from what these runs take on a loaded machine, so that every
# limit but the timeout is what ends them; SHORT's runs are the ones meant to time out
LIMITS = SandboxConfig(timeout_s=60.0, cpu_time_s=1, memory_bytes=256 << 20, max_processes=32)
SHORT = dataclasses.replace(LIMITS, timeout_s=2.0)


def _bwrap_works() -> str | None:
    try:
        SandboxPool(LIMITS).close()
    except SandboxUnavailableError as exc:
        return str(exc)
    return None


_UNAVAILABLE = _bwrap_works()
needs_bwrap = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no sandbox: {_UNAVAILABLE}")


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    if _UNAVAILABLE is not None:
        pytest.skip(f"no sandbox: {_UNAVAILABLE}")
    pool = SandboxPool(LIMITS, max_concurrent=32)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def short_pool() -> Iterator[SandboxPool]:
    if _UNAVAILABLE is not None:
        pytest.skip(f"no sandbox: {_UNAVAILABLE}")
    pool = SandboxPool(SHORT)
    yield pool
    pool.close()


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


def python(session: SandboxSession, code: str) -> str:
    return run(session.run_python(code))


def python_error(session: SandboxSession, code: str) -> str:
    with pytest.raises(SandboxRunError) as error:
        python(session, code)
    return str(error.value)


def processes_with(marker: str) -> list[str]:
    """Host processes whose command line holds ``marker`` (zombies included)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(entry.name)
            except OSError:
                continue
    return found


@pytest.fixture(autouse=True)
def nothing_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test, no process of a sandbox (their command lines name the pool's
    folder) is still there."""
    yield
    for name in ("pool", "short_pool"):
        if name in request.fixturenames:
            pool = request.getfixturevalue(name)
            assert processes_with(str(pool.root)) == []


# ---------------------------------------------------------------- isolation


@needs_bwrap
def test_code_cannot_connect_to_the_hosts_loopback_or_anywhere_else(pool: SandboxPool) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the timeout: nothing came
            accepted.append(listener.accept())

    code = f"""
import socket
for address in [("127.0.0.1", {port}), ("10.0.0.1", 80), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1)
        print("connected", address)
    except OSError as exc:
        print("blocked", address, type(exc).__name__)
"""
    watcher = threading.Thread(target=accept)
    watcher.start()
    output = python(pool.session(), code)
    watcher.join()
    listener.close()
    assert output.count("blocked") == 3 and "connected" not in output, output
    assert accepted == []


@needs_bwrap
@pytest.mark.skipif(socket_filter() is None, reason="no seccomp filter for this machine")
def test_code_cannot_even_open_a_network_socket_but_unix_sockets_work(pool: SandboxPool) -> None:
    code = """
import socket
for family in (socket.AF_INET, socket.AF_INET6, socket.AF_PACKET, socket.AF_NETLINK):
    try:
        socket.socket(family, socket.SOCK_RAW if family != socket.AF_INET else socket.SOCK_STREAM)
        print("opened", family.name)
    except PermissionError:
        print("refused", family.name)
left, right = socket.socketpair(socket.AF_UNIX)
left.send(b"unix ok")
print(right.recv(16).decode())
"""
    output = python(pool.session(), code)
    assert output.split("\n")[:5] == [
        "refused AF_INET",
        "refused AF_INET6",
        "refused AF_PACKET",
        "refused AF_NETLINK",
        "unix ok",
    ], output
    bash = run(pool.session().run_bash("echo hi > /dev/tcp/127.0.0.1/80 || echo refused"))
    assert "socket: Permission denied" in bash and bash.strip().endswith("refused")


@needs_bwrap
def test_code_cannot_read_the_project_shadow_root_or_the_parents_environment(
    pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"secret-{uuid.uuid4()}"
    monkeypatch.setenv("PTC_TEST_SECRET", secret)
    code = f"""
import os
for path in ["/etc/shadow", "/etc/passwd", "/root", {str(PROJECT)!r}, {str(__file__)!r},
             "/proc/{os.getpid()}/environ"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path).read()
        print("read", path)
    except OSError as exc:
        print("denied", path, type(exc).__name__)
print(json.dumps(dict(os.environ)))
""".replace("print(json.dumps", "import json; print(json.dumps")
    output = python(pool.session(), code)
    assert "read " not in output, output
    assert output.count("denied") == 6
    environment = json.loads(output.splitlines()[-1])
    assert secret not in output
    assert set(environment) >= {"PATH", "HOME"} and "PTC_TEST_SECRET" not in environment
    assert environment["HOME"] == "/home/sandbox"


@needs_bwrap
def test_writes_outside_scratch_fail_and_scratch_lasts_the_episode(pool: SandboxPool) -> None:
    session = pool.session()
    output = python(
        session,
        """
import os
for path in ["/usr/x", "/etc/x", "/x", "/home/x", "/proc/x", "/dev/x"]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as exc:
        print("refused", path)
open("notes.txt", "w").write("kept")
open("/tmp/t", "w").write("gone")
print(os.getcwd(), os.getuid())
""",
    )
    assert "wrote" not in output and output.count("refused") == 6, output
    assert "/home/sandbox 65534" in output
    # the scratch folder is the episode's: the next call (bash too) reads it; /tmp is per run
    bash = run(session.run_bash("cat notes.txt; echo; ls /tmp | wc -l"))
    assert bash.split() == ["kept", "0"]
    other = python(pool.session(), "import os; print(os.listdir('.'))")
    assert other.strip() == "[]"


# ---------------------------------------------------------------- limits, each a tool error


@needs_bwrap
def test_a_program_past_its_timeout_is_killed_with_everything_it_started(
    short_pool: SandboxPool,
) -> None:
    marker = f"ptc-{uuid.uuid4().hex[:12]}"
    # exec -a: the sleeps' command lines carry the marker, to be looked for afterwards
    command = f"(exec -a {marker} sleep 300) & (exec -a {marker} sleep 200); wait"
    error = run_bash_error(short_pool.session(), command)
    assert "timed out after 2 s" in error
    assert processes_with(marker) == []


@needs_bwrap
def test_a_daemon_does_not_outlive_a_program_that_exits(pool: SandboxPool) -> None:
    marker = f"ptc-{uuid.uuid4().hex[:12]}"
    code = f"""
import os, subprocess
subprocess.Popen(["bash", "-c", "exec -a {marker} sleep 300"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("started")
"""
    assert python(pool.session(), code).strip() == "started"
    assert processes_with(marker) == []


def run_bash_error(session: SandboxSession, command: str) -> str:
    with pytest.raises(SandboxRunError) as error:
        run(session.run_bash(command))
    return str(error.value)


@needs_bwrap
def test_a_python_fork_bomb_ends_with_a_tool_error(short_pool: SandboxPool) -> None:
    marker = f"ptc-{uuid.uuid4().hex[:12]}"
    error = python_error(short_pool.session(), f"# {marker}\nimport os\nwhile True:\n    os.fork()")
    assert "the sandbox allows 32 processes" in error or "timed out" in error
    assert processes_with(marker) == []


@needs_bwrap
def test_a_bash_fork_bomb_ends_with_a_tool_error(short_pool: SandboxPool) -> None:
    marker = f"ptc-{uuid.uuid4().hex[:12]}"
    error = run_bash_error(short_pool.session(), f"# {marker}\nbomb() {{ bomb | bomb; }}; bomb")
    assert "timed out" in error or "Resource temporarily unavailable" in error
    assert processes_with(marker) == []


@needs_bwrap
def test_a_memory_bomb_ends_with_a_tool_error_naming_the_limit(pool: SandboxPool) -> None:
    error = python_error(
        pool.session(), "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))"
    )
    assert "MemoryError" in error and f"{256 << 20} bytes of address space" in error


@needs_bwrap
def test_an_infinite_loop_ends_on_its_cpu_limit(pool: SandboxPool) -> None:
    error = python_error(pool.session(), "while True:\n    pass")
    assert error.startswith("SIGXCPU: its CPU time limit (1 s) ran out"), error


@needs_bwrap
def test_a_hundred_megabytes_of_output_end_at_the_cap(pool: SandboxPool) -> None:
    error = python_error(pool.session(), "import sys\nsys.stdout.write('x' * 100_000_000)\n")
    assert error.startswith(f"its output passed {LIMITS.max_output_bytes} bytes")
    assert error.count("x") == LIMITS.max_output_bytes


@needs_bwrap
def test_a_file_past_the_size_limit_and_a_full_scratch_are_tool_errors(
    pool: SandboxPool,
) -> None:
    small = SandboxPool(
        dataclasses.replace(LIMITS, max_file_bytes=1 << 20, max_scratch_bytes=3 << 20)
    )
    try:
        session = small.session()
        error = python_error(session, "open('big', 'wb').write(b'x' * (2 << 20))")
        # Python ignores SIGXFSZ, so the write fails instead of killing it
        assert error.startswith(f"exit status 1 (the file size limit is {1 << 20} bytes)")
        assert "File too large" in error
        fill = "for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
        # the file the failed write left (1 MiB, up to the limit) and four more
        assert "held 5242880 bytes, over its limit of 3145728" in python_error(session, fill)
        assert python(session, "import os; print(os.listdir('.'))").strip() == "[]"
    finally:
        small.close()


@needs_bwrap
def test_a_failing_program_reports_its_exit_status_and_output(pool: SandboxPool) -> None:
    error = run_bash_error(pool.session(), "echo partial; exit 3")
    assert error == "exit status 3\npartial\n"


# ---------------------------------------------------------------- many at once, and the env


@needs_bwrap
def test_thirty_two_concurrent_runs_each_get_their_own_answer_and_folder(
    pool: SandboxPool,
) -> None:
    sessions = [pool.session() for _ in range(32)]

    async def all_at_once() -> list[str]:
        return await asyncio.gather(
            *(
                s.run_python(f"import os\nopen('me', 'w').write('{i}')\nprint({i} * {i})")
                for i, s in enumerate(sessions)
            )
        )

    outputs = run(all_at_once())
    assert [int(output) for output in outputs] == [i * i for i in range(32)]

    async def read_back() -> list[str]:
        return await asyncio.gather(*(s.run_bash("cat me") for s in sessions))

    reads = run(read_back())
    assert reads == [str(i) for i in range(32)]
    for session in sessions:
        run(session.close())


@needs_bwrap
def test_tool_env_runs_code_tools_and_closing_it_removes_the_scratch(pool: SandboxPool) -> None:
    tools = code_tools(pool)
    env = ToolEnv(tools, reward_fn=exact_answer)
    assert [spec["function"]["name"] for spec in env.tool_specs] == ["python", "bash"]

    def call(name: str, **arguments: str) -> Message:
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

    async def episode() -> tuple[list[Message], float]:
        await env.reset(Task(prompt="What is 6 * 7?", target="42"))
        await env.step(call("python", code="open('a', 'w').write(str(6 * 7))"))
        await env.step(call("bash", command="cat a; exit 1"))
        await env.step(call("python", code="print(open('a').read())"))
        result = await env.step(Message(role="assistant", content="42"))
        return result.messages, result.reward

    messages, reward = run(episode())
    tool_messages = [m["content"] for m in messages if m["role"] == "tool"]
    assert tool_messages == ["", "tool_error: exit status 1\n42", "42\n"]
    assert reward == 1.0
    scratch = tools[0].session._scratch
    assert scratch is not None and scratch.is_dir()
    run(env.close())
    assert not scratch.exists()
