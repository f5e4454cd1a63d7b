"""The policy server under load on loopback: tens of concurrent streaming chat completions for
minutes, with the clients a real deployment meets, and the server's memory and threads watched.

    python benchmarks/server_load.py [--clients 32] [--duration 600] [--out server_load.json]

Starts ``post-training-cookbook serve`` with the bundled model (the one the README's main job
trains) on 127.0.0.1 in a process of its own, then runs ``--clients`` clients, each sending one
request after another until ``--duration`` is up. Each request is drawn from ``MIX``:

- ``plain``: a streamed chat completion, no tools;
- ``tools``: the tool-use game's tools and a task; when the reply calls a tool, a second call
  continues the conversation with a tool result (the token-in-token-out path);
- ``disconnect``: a streamed completion the client drops after its first event;
- ``cancel``: a long completion (16 choices of up to 1,024 tokens, seconds of sampling) the
  client abandons after up to half a second, before any answer: the server should stop
  sampling it;
- ``oversize``: a prompt about three times the served context: must get a 4xx.

Every request streams with ``include_usage``, under ``--request-timeout`` (one that runs past it
is a hang). The server answers a stream once its completion is computed whole
(``serve/wire.py``), so time to first token is close to the total. Every ``--sample-every``
seconds the server's RSS, threads, open file descriptors and CPU time are read from
``/proc/<pid>``. After the load: four more long completions abandoned after 0.3 s
(``abandon``), the time until the server's CPU goes idle (work it would still do for clients
that are gone), one more completion, and a clean stop on SIGINT.

Prints a table and writes the JSON result; exits 1 when any check in ``failures`` fails: any
5xx, hang, connection error or malformed stream, a well-formed request refused with a 4xx, an
oversize prompt not answered 4xx, a traceback in the server's log, the server still busy
``IDLE_WITHIN_S`` after the load, or RSS or threads growing over the last half of the load
(``flatness``). The server's memory grows until its bounded stores are full: the engine's
prefix cache (``--prefix-cache-bytes``, 256 MiB here rather than the machine's share, so that
it fills in seconds), its decode buffers, and the 4,096 conversation turns it remembers
(``serve/conversations.py``); at 32 clients on two busy cores that took about 100 s, so runs
much shorter than the default ten minutes fail the flatness check on the growth of warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
from post_training_cookbook.envs.tool_use_game.env import SYSTEM_PROMPT
from post_training_cookbook.models import BUNDLED_MODEL_ID

MIX = {"plain": 4, "tools": 4, "disconnect": 1, "cancel": 1, "oversize": 1}
"""Each request's kind is drawn with these weights."""
RSS_SLOPE_BOUND = 0.02
"""Flat: the last half's least-squares RSS slope, times its length, within 2% of its median..."""
RSS_SPREAD_BOUND = 0.05
"""...its max - min within 5% of its median (and within 16 MiB whatever the median)..."""
MIN_BOUND_BYTES = 16 * 2**20
"""...and no thread started in the last half that the first half did not reach."""
IDLE_WITHIN_S = 5.0
"""The server's CPU use falls below 10% of a core this soon after the last client is done."""
STREAM_END = "data: [DONE]"


@dataclass(frozen=True)
class LoadSettings:
    clients: int = 32
    duration_s: float = 600.0
    request_timeout_s: float = 60.0
    """A request not answered whole this long after it was sent is a hang."""
    max_tokens: int = 64
    """The most tokens of a plain or tool-use completion (each draws from 8 up to this)."""
    max_model_length: int = 2048
    """The served context (the bundled model's own); oversize prompts are three times it."""
    prefix_cache_bytes: int = 256 * 2**20
    sample_every_s: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_bytes: int
    threads: int
    fds: int
    cpu_s: float


# ---------------------------------------------------------------- the server's process


def read_process(pid: int) -> tuple[int, int, int, float]:
    """RSS bytes, threads, open file descriptors and CPU seconds of ``pid``, from ``/proc``."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    rss = int(status["VmRSS"].split()[0]) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, int(status["Threads"]), fds, cpu


class ServerProcess:
    """``post-training-cookbook serve`` of the bundled model on a free loopback port."""

    def __init__(self, settings: LoadSettings, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        command = [
            sys.executable, "-m", "post_training_cookbook", "serve", BUNDLED_MODEL_ID,
            "--port", str(self.port), "--max-model-length", str(settings.max_model_length),
            "--prefix-cache-bytes", str(settings.prefix_cache_bytes),
        ]  # fmt: skip
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, within_s: float = 300.0) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited at start:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.process.kill()
        raise RuntimeError(f"the server did not answer /health within {within_s:g}s")

    def stop(self, within_s: float = 30.0) -> int | None:
        """SIGINT (how the ``serve`` command stops); its exit code, None when it did not stop
        in time (then it is killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(within_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def log_errors(self) -> list[str]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line for line in lines if "Traceback" in line or line.startswith("ERROR")]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- the clients


@dataclass
class Requests:
    """What the clients send: the tool-use game's tools and tasks, and the served context."""

    settings: LoadSettings
    rng: random.Random
    tools: list[Any] = field(default_factory=lambda: ToolUseGameEnv().tool_specs)

    def kind(self) -> str:
        return self.rng.choices(list(MIX), weights=list(MIX.values()))[0]

    def body(self, kind: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "load",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.rng.randint(8, self.settings.max_tokens),
        }
        if kind == "tools":
            task = self.rng.choice(TOOL_USE_GAME_VAL_TASKS)
            system = {"role": "system", "content": SYSTEM_PROMPT}
            return {**body, "messages": [system, {"role": "user", "content": task.prompt}],
                    "tools": self.tools}  # fmt: skip
        oversize = kind == "oversize"
        words = 3 * self.settings.max_model_length if oversize else self.rng.randint(1, 40)
        body["messages"] = [{"role": "user", "content": " ".join(["kalo"] * words)}]
        if kind == "cancel":
            body |= {"n": 16, "max_tokens": 1024}
        return body

    def tool_result(self, asked: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        """``asked`` continued by its reply and a result for each of its tool calls."""
        results = [
            {"role": "tool", "tool_call_id": call["id"], "content": str(self.rng.randint(1, 99))}
            for call in reply["tool_calls"]
        ]
        return {**asked, "messages": [*asked["messages"], reply, *results]}


@dataclass
class Outcome:
    kind: str
    started_s: float
    status: int | None = None
    """The HTTP status; None when none came."""
    error: str | None = None
    """What went wrong (``failures`` says which count), None when nothing did."""
    ttft_s: float | None = None
    """To the first event."""
    total_s: float | None = None
    """To ``[DONE]``, for a whole answer."""
    completion_tokens: int = 0
    reply: dict[str, Any] | None = field(default=None, repr=False)
    """The assistant message the events spelled out."""


async def read_stream(client: httpx.AsyncClient, outcome: Outcome, body: dict[str, Any]) -> None:
    """One streamed completion read into ``outcome`` as a client reads it; ``disconnect``
    drops the connection after the first event."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return
        done, reply = False, {"role": "assistant", "content": None}
        async for line in response.aiter_lines():
            if not line:
                continue
            if outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - outcome.started_s
                if outcome.kind == "disconnect":
                    return  # leaving the block unread closes the connection
            if done or not line.startswith("data: "):
                outcome.error = "bad_stream"
                return
            if line == STREAM_END:
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                outcome.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                for name, value in choice["delta"].items():
                    if name == "tool_calls":
                        value = [{k: v for k, v in call.items() if k != "index"} for call in value]
                    if name in ("content", "tool_calls"):
                        reply[name] = value
        if not done:
            outcome.error = "bad_stream"
            return
        outcome.total_s = time.monotonic() - outcome.started_s
        outcome.reply = reply


async def attempt(
    client: httpx.AsyncClient,
    kind: str,
    body: dict[str, Any],
    timeout_s: float,
    abandon_after_s: float | None = None,
) -> Outcome:
    """One request, its failures named: ``hang`` (past ``timeout_s``), ``connect``, ``dropped``
    (the server closed the connection), ``bad_stream``, and by status (``status_error``).
    ``abandon_after_s``: the client gives up then and closes the connection (not an error)."""
    outcome = Outcome(kind, time.monotonic())
    try:
        async with asyncio.timeout(abandon_after_s or timeout_s):
            await read_stream(client, outcome, body)
    except TimeoutError:
        outcome.error = None if abandon_after_s else "hang"
    except httpx.TimeoutException:
        outcome.error = "hang"
    except httpx.ConnectError:
        outcome.error = "connect"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        outcome.error = "dropped"
    except (ValueError, KeyError, TypeError):  # JSON that is not a chunk
        outcome.error = "bad_stream"
    if outcome.status is not None and outcome.error is None:
        outcome.error = status_error(kind, outcome.status)
    return outcome


def status_error(kind: str, status: int) -> str | None:
    if status >= 500:
        return "5xx"
    if kind == "oversize":
        return None if 400 <= status < 500 else "oversize_not_4xx"
    if status == 429:
        return "busy"  # more clients than --max-concurrent-requests: expected, not a failure
    return None if status == 200 else "refused_4xx"


async def client_loop(
    client: httpx.AsyncClient,
    requests: Requests,
    first_kind: str,
    deadline: float,
    settings: LoadSettings,
    outcomes: list[Outcome],
) -> None:
    """Requests one after another until ``deadline``; a tool call gets its result back."""
    kind, timeout_s = first_kind, settings.request_timeout_s
    while time.monotonic() < deadline:
        body = requests.body(kind)
        patience = requests.rng.uniform(0.0, 0.5) if kind == "cancel" else None
        outcome = await attempt(client, kind, body, timeout_s, patience)
        outcomes.append(outcome)
        if outcome.reply and outcome.reply.get("tool_calls") and time.monotonic() < deadline:
            follow = requests.tool_result(body, outcome.reply)
            outcomes.append(await attempt(client, "tool_result", follow, timeout_s))
        kind = requests.kind()


async def abandon(client: httpx.AsyncClient, timeout_s: float) -> list[Outcome]:
    """Four completions of seconds each (seeded: each has choices that run to 1,024 tokens),
    abandoned after 0.3 s."""
    body = {"messages": [{"role": "user", "content": "kalo"}], "n": 16, "max_tokens": 1024,
            "stream": True}  # fmt: skip
    asked = [
        attempt(client, "abandon", {**body, "seed": seed}, timeout_s, 0.3) for seed in range(4)
    ]
    return list(await asyncio.gather(*asked))


# ---------------------------------------------------------------- watching the server


async def watch(
    pid: int, t0: float, every_s: float, samples: list[Sample], stop: asyncio.Event
) -> None:
    while True:
        samples.append(Sample(time.monotonic() - t0, *read_process(pid)))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass


async def seconds_until_idle(pid: int, within_s: float) -> float | None:
    """Seconds until ``pid`` uses under 10% of a core over half a second; None: not within."""
    started = time.monotonic()
    cpu = read_process(pid)[3]
    while time.monotonic() - started < within_s:
        await asyncio.sleep(0.5)
        now = read_process(pid)[3]
        if now - cpu < 0.05:
            return time.monotonic() - started - 0.5
        cpu = now
    return None


def flatness(samples: list[Sample], start_s: float, end_s: float) -> dict[str, Any]:
    """Whether RSS and threads stayed flat over the last half of [start_s, end_s] (the
    bounds are ``RSS_SLOPE_BOUND`` and the two after it); ``flat`` None: too few samples."""
    middle = (start_s + end_s) / 2
    first = [s for s in samples if start_s <= s.t_s < middle]
    last = [s for s in samples if middle <= s.t_s <= end_s]
    if len(first) < 2 or len(last) < 3:
        return {"flat": None, "samples_last_half": len(last)}
    times = [s.t_s for s in last]
    rss = [s.rss_bytes for s in last]
    mean_t, mean_rss = statistics.fmean(times), statistics.fmean(rss)
    spread_t = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (r - mean_rss) for t, r in zip(times, rss, strict=True)) / spread_t
    median = statistics.median(rss)
    growth, spread = slope * (end_s - middle), max(rss) - min(rss)
    rss_flat = growth <= max(MIN_BOUND_BYTES, RSS_SLOPE_BOUND * median) and spread <= max(
        MIN_BOUND_BYTES, RSS_SPREAD_BOUND * median
    )
    threads_first, threads_last = max(s.threads for s in first), max(s.threads for s in last)
    return {
        "flat": rss_flat and threads_last <= threads_first,
        "rss_flat": rss_flat,
        "rss_median_mib": median / 2**20,
        "rss_growth_by_slope_mib": growth / 2**20,
        "rss_spread_mib": spread / 2**20,
        "threads_max_first_half": threads_first,
        "threads_max_last_half": threads_last,
        "samples_last_half": len(last),
    }


# ---------------------------------------------------------------- the run


async def run_load(settings: LoadSettings, log_path: Path) -> dict[str, Any]:
    """Start the server, load it for ``settings.duration_s``, stop it; the result record."""
    server = ServerProcess(settings, log_path)
    try:
        await asyncio.to_thread(server.wait_ready)
        result = await load(server.base_url, server.process.pid, settings)
    except BaseException:
        print(f"the server's log ends:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        exit_code = server.stop()
    result["server"] |= {"exit_code": exit_code, "log_errors": server.log_errors()[:20]}
    return result


async def load(base_url: str, pid: int, settings: LoadSettings) -> dict[str, Any]:
    """Load the server at ``base_url`` (its process ``pid``) and watch it; ``failures`` reads
    the record this returns."""
    t0 = time.monotonic()
    samples: list[Sample] = []
    stop_watching = asyncio.Event()
    watcher = asyncio.create_task(watch(pid, t0, settings.sample_every_s, samples, stop_watching))
    fds_before = read_process(pid)[2]
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=2 * settings.clients)
    timeout_s = settings.request_timeout_s
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=httpx.Timeout(timeout_s + 5.0)
    ) as client:
        start_s = time.monotonic() - t0
        deadline = time.monotonic() + settings.duration_s
        kinds = list(MIX)
        await asyncio.gather(*(
            client_loop(client, Requests(settings, random.Random(settings.seed * 1000 + i)),
                        kinds[i % len(kinds)], deadline, settings, outcomes)
            for i in range(settings.clients)
        ))  # fmt: skip
        end_s = time.monotonic() - t0
        outcomes += await abandon(client, timeout_s)
        idle_s = await seconds_until_idle(pid, 60.0)
        plain = Requests(settings, random.Random(-1)).body("plain")
        after = await attempt(client, "after", plain, timeout_s)
    await asyncio.sleep(1.0)  # the server closes the connections
    fds_after = read_process(pid)[2]
    stop_watching.set()
    await watcher
    during = [s for s in samples if start_s <= s.t_s <= end_s]
    return {
        "settings": asdict(settings),
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "load_s": end_s - start_s,
        "kinds": kind_table(outcomes),
        "statuses": count(str(o.status) for o in outcomes),
        "errors": count(o.error for o in outcomes if o.error),
        "throughput": throughput(outcomes, end_s - start_s),
        "server": {
            "flatness": flatness(samples, start_s, end_s),
            "rss_mib_first_last_max": first_last_max([s.rss_bytes / 2**20 for s in during]),
            "threads_first_last_max": first_last_max([s.threads for s in during]),
            "fds_before_after": [fds_before, fds_after],
            "idle_after_abandon_s": idle_s,
            "after_load_status": after.status,
            "after_load_error": after.error,
        },
        "samples": [asdict(s) for s in samples],
    }


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def count(items: Any) -> dict[str, int]:
    return dict(sorted(Counter(items).items()))


def kind_table(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    table = {}
    for kind in [*MIX, "tool_result", "abandon", "all"]:
        chosen = [o for o in outcomes if kind in (o.kind, "all")]
        ttft = [o.ttft_s for o in chosen if o.ttft_s is not None and o.total_s is not None]
        total = [o.total_s for o in chosen if o.total_s is not None]
        table[kind] = {
            "sent": len(chosen),
            "whole": len(total),
            "4xx": sum(1 for o in chosen if o.status and 400 <= o.status < 500),
            "5xx": sum(1 for o in chosen if o.status and o.status >= 500),
            "errors": sum(1 for o in chosen if o.error and o.error != "busy"),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "total_p50_s": percentile(total, 50),
            "total_p99_s": percentile(total, 99),
        }
    return table


def throughput(outcomes: list[Outcome], load_s: float) -> dict[str, float]:
    whole = [o for o in outcomes if o.total_s is not None]
    return {
        "completions_per_s": len(whole) / load_s,
        "tokens_per_s": sum(o.completion_tokens for o in whole) / load_s,
    }


def first_last_max(values: list[float]) -> list[float]:
    return [values[0], values[-1], max(values)] if values else []


FAILING_ERRORS = ("5xx", "hang", "connect", "dropped", "bad_stream", "refused_4xx",
                  "oversize_not_4xx")  # fmt: skip


def failures(result: dict[str, Any]) -> list[str]:
    """What makes the run fail (module docstring)."""
    found = [f"{n} {error}" for error, n in result["errors"].items() if error in FAILING_ERRORS]
    server = result["server"]
    if server["flatness"]["flat"] is False:
        found.append("RSS or threads grew over the last half (see the table)")
    idle = server["idle_after_abandon_s"]
    if idle is None or idle > IDLE_WITHIN_S:
        found.append(f"the server was still busy {idle or '60+'} s after its clients left")
    if server["after_load_status"] != 200 or server["after_load_error"]:
        found.append(f"a completion after the load: {server['after_load_status']}")
    before, after = server["fds_before_after"]
    if after > before + 2:
        found.append(f"open file descriptors {before} before the load, {after} after")
    if server.get("log_errors"):
        found.append(f"{len(server['log_errors'])} errors in the server's log")
    if "exit_code" in server and server["exit_code"] is None:
        found.append("the server did not stop on SIGINT within 30 s")
    return found


def print_table(result: dict[str, Any]) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(f"{'kind':<12}{'sent':>7}{'whole':>7}{'4xx':>6}{'5xx':>5}{'errors':>8}"
          f"{'ttft p50':>10}{'p99':>7}{'total p50':>11}{'p99':>7}")  # fmt: skip
    for kind, row in result["kinds"].items():
        print(f"{kind:<12}{row['sent']:>7}{row['whole']:>7}{row['4xx']:>6}{row['5xx']:>5}"
              f"{row['errors']:>8}{seconds(row['ttft_p50_s']):>10}{seconds(row['ttft_p99_s']):>7}"
              f"{seconds(row['total_p50_s']):>11}{seconds(row['total_p99_s']):>7}")  # fmt: skip
    rate, server = result["throughput"], result["server"]
    rss, threads, flat = (
        server["rss_mib_first_last_max"],
        server["threads_first_last_max"],
        server["flatness"],
    )
    print(
        f"load {result['load_s']:.0f} s, {result['settings']['clients']} clients: "
        f"{rate['completions_per_s']:.2f} completions/s, {rate['tokens_per_s']:.1f} tokens/s"
    )
    print(f"statuses {result['statuses']}  errors {result['errors']}")
    print(
        f"server RSS MiB first/last/max {rss[0]:.0f}/{rss[1]:.0f}/{rss[2]:.0f}, threads "
        f"{threads[0]}/{threads[1]}/{threads[2]}, fds before/after {server['fds_before_after']}"
    )
    if flat["flat"] is not None:
        print(
            f"last half: RSS {flat['rss_growth_by_slope_mib']:+.1f} MiB by its slope, spread "
            f"{flat['rss_spread_mib']:.1f} MiB around {flat['rss_median_mib']:.0f}; threads at "
            f"most {flat['threads_max_first_half']} then {flat['threads_max_last_half']}: "
            + ("flat" if flat["flat"] else "GROWING")
        )
    idle = seconds(server["idle_after_abandon_s"])
    print(f"idle {idle} s after its clients left; exit code {server['exit_code']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = LoadSettings()
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--max-model-length", type=int, default=defaults.max_model_length)
    parser.add_argument("--prefix-cache-bytes", type=int, default=defaults.prefix_cache_bytes)
    parser.add_argument("--sample-every", type=float, default=defaults.sample_every_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=Path("server_load.json"))
    args = parser.parse_args()
    settings = LoadSettings(
        args.clients, args.duration, args.request_timeout, args.max_tokens,
        args.max_model_length, args.prefix_cache_bytes, args.sample_every, args.seed,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        result = asyncio.run(run_load(settings, Path(folder) / "server.log"))
    result["failures"] = failures(result)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    for failure in result["failures"]:
        print("FAIL:", failure)
    print(f"wrote {args.out}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
