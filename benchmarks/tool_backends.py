"""What a sandboxed code call and an MCP tool call cost, measured side by side.

    python benchmarks/tool_backends.py [--calls 30] [--concurrency 8]

Times the same tiny program (``print(6 * 7)``) run through the sandbox (bubblewrap), through
the plain subprocess the sandbox refuses to fall back to unless asked
(``isolation="unsafe_subprocess"``: same limits, no isolation), and as a bare
``python3 -I -S -c`` subprocess; then one ``tools/call`` to an MCP server over stdio
(``tests/mcp_server.py``'s ``add``), once started. Prints the median latency per call of
each, one after the other, and their ratios to the bare subprocess; then the throughput
of ``--concurrency`` sandboxed calls at once. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

from post_training_cookbook.tool_backends.mcp_connection import MCPStdioServer
from post_training_cookbook.tool_backends.mcp_tools import MCPToolbox
from post_training_cookbook.tool_backends.sandbox import SandboxConfig, SandboxPool
from post_training_cookbook.tool_backends.sandbox.config import python_for_sandbox

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = "print(6 * 7)"


def bare_call() -> None:
    subprocess.run(
        [python_for_sandbox(), "-I", "-S", "-c", PROGRAM], check=True, capture_output=True
    )


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


async def timed(calls: int, call: object) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await call()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return times


async def main(calls: int, concurrency: int) -> None:
    bare = []
    for _ in range(calls):
        start = time.perf_counter()
        bare_call()
        bare.append(time.perf_counter() - start)
    sandbox = SandboxPool(SandboxConfig(), max_concurrent=concurrency)
    unsafe = SandboxPool(SandboxConfig(isolation="unsafe_subprocess"))
    isolated_session, unsafe_session = sandbox.session(), unsafe.session()
    isolated = await timed(calls, lambda: isolated_session.run_python(PROGRAM))
    plain = await timed(calls, lambda: unsafe_session.run_python(PROGRAM))
    server = MCPStdioServer(
        sys.executable,
        (str(ROOT / "tests" / "mcp_server.py"), "stdio"),
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    start = time.perf_counter()
    with MCPToolbox(server, tool_names=["add"]) as toolbox:
        started_s = time.perf_counter() - start
        (add,) = toolbox.tools()
        mcp = await timed(calls, lambda: add.execute('{"a": 1, "b": 2}'))
    sessions = [sandbox.session() for _ in range(concurrency * 4)]
    start = time.perf_counter()
    await asyncio.gather(*(s.run_python(PROGRAM) for s in sessions))
    burst_s = time.perf_counter() - start
    sandbox.close()
    unsafe.close()

    base = median_ms(bare)
    print(f"median latency of one call, {calls} calls each (ratio to a bare subprocess):")
    for name, times in [
        ("bare python3 -I -S -c subprocess", bare),
        ("sandbox (bubblewrap)", isolated),
        ("unsafe_subprocess (limits only)", plain),
        ("MCP tools/call over stdio, server started", mcp),
    ]:
        print(f"  {name:45s} {median_ms(times):8.1f} ms   x{median_ms(times) / base:5.2f}")
    print(f"  MCP server start and tools/list: {started_s * 1000:.0f} ms")
    print(
        f"{len(sessions)} sandboxed calls, {concurrency} at once: {burst_s:.2f} s, "
        f"{len(sessions) / burst_s:.1f} calls/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.calls, arguments.concurrency))
