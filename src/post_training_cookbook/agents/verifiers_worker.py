"""The worker that runs a ``verifiers`` environment for ``VerifiersEnvs`` (``verifiers_envs.py``).

It runs in the verifiers venv (``scripts/verifiers_venv.sh``: verifiers pins ``openai<3`` and
``mcp==2.0.0``, which clash with ours), as a script, and imports nothing from this package:

    .venv-verifiers/bin/python verifiers_worker.py '<config as JSON>'

The config: ``{"taskset": {"id": MODULE, ...}, "max_turns": N or null, "paths": [...],
"uv": false}``. ``taskset`` is verifiers' ``TasksetConfig`` (its ``id`` an importable module,
``paths`` put first on ``sys.path`` and on the ``PYTHONPATH`` of verifiers' processes); the
episodes are played by verifiers' ``SingleAgentEnv`` with its ``null`` harness (the
taskset's prompt, tools and rubric; no code execution) in the ``subprocess`` runtime on this
machine. The harness's chat program runs with this interpreter, which has its dependencies,
unless ``uv`` is true (then verifiers' own ``uv sync --script``).

It speaks JSON lines: one line on stdout once the env is loaded (``{"ready": {"tasks": N,
"verifiers": VERSION}}``, or ``{"fatal": MESSAGE}`` before it exits), then one answer per
request read from stdin, by ``id``, requests served concurrently:

    {"id": 1, "op": "tasks"}
        -> {"id": 1, "result": [{"index", "key", "prompt", "system_prompt", "answer", "data"}]}
    {"id": 2, "op": "run", "task": INDEX, "base_url": URL, "api_key": KEY,
     "sampling": {"max_tokens": 64}}
        -> {"id": 2, "result": {"reward", "rewards": {name: {"score", "weight"}}, "ok",
            "errors": [{"type", "message"}], "stop_condition", "num_turns", "messages"}}
    {"id": 3, "op": "score", "task": INDEX, "messages": [OpenAI chat messages]}
        -> {"id": 3, "result": {"reward", "rewards": {name: {"score", "weight"}}}}

A request that fails gets ``{"id", "error": MESSAGE}``. Whatever verifiers or its programs
print goes to stderr: stdout carries the protocol alone. Once stdin closes, the worker
answers the requests it has and ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import sys
import threading
import traceback
from typing import Any, TextIO

KEY_VARIABLE = "PTC_VERIFIERS_EPISODE_KEY_"
"""verifiers reads a client's API key from the environment variable its config names: one
variable per episode, set while it runs."""


def main(argv: list[str]) -> int:
    script_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != script_dir]
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # prints of verifiers and of its programs go to stderr
    sys.stdout = sys.stderr
    config = json.loads(argv[1]) if len(argv) > 1 else {}
    try:
        asyncio.run(Worker(config, protocol).serve())
    except Exception:
        write(protocol, {"fatal": traceback.format_exc(limit=8)})
        return 1
    return 0


def write(out: TextIO, answer: dict[str, Any]) -> None:
    out.write(json.dumps(answer) + "\n")
    out.flush()


class Worker:
    def __init__(self, config: dict[str, Any], out: TextIO) -> None:
        self.config = config
        self.out = out
        self.counter = itertools.count()

    async def serve(self) -> None:
        paths = [str(path) for path in self.config.get("paths") or []]
        sys.path[:0] = paths
        if paths:  # and for verifiers' processes: a task's MCP server imports its package
            inherited = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [*paths, *([inherited] if inherited else [])]
            )
        import verifiers
        import verifiers.v1 as vf

        if not self.config.get("uv"):
            run_uv_scripts_with_this_python()
        agent: dict[str, Any] = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
        if self.config.get("max_turns") is not None:
            agent["max_turns"] = self.config["max_turns"]
        env_config = vf.SingleAgentEnvConfig(taskset=self.config["taskset"], agent=agent)
        self.vf = vf
        self.env = vf.load_environment(env_config)
        self.tasks = list(self.env.taskset)
        version = getattr(verifiers, "__version__", "?")
        async with self.env.serving():
            write(self.out, {"ready": {"tasks": len(self.tasks), "verifiers": version}})
            await self.answer_requests()

    async def answer_requests(self) -> None:
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=read, daemon=True).start()
        running: set[asyncio.Task[None]] = set()
        while (line := await lines.get()) is not None:
            if not line.strip():
                continue
            task = asyncio.create_task(self.answer(line))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)  # stdin closed: finish what was asked, then end

    async def answer(self, line: str) -> None:
        request_id = None
        try:
            request = json.loads(line)
            request_id = request.get("id")
            op = request.get("op")
            if op == "tasks":
                result: Any = [self.describe(i, task) for i, task in enumerate(self.tasks)]
            elif op == "run":
                result = await self.run(request)
            elif op == "score":
                result = await self.score(request)
            else:
                raise ValueError(f"unknown op {op!r}")
            write(self.out, {"id": request_id, "result": result})
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            write(self.out, {"id": request_id, "error": message})

    def task(self, request: dict[str, Any]) -> Any:
        index = request.get("task")
        if not isinstance(index, int) or not 0 <= index < len(self.tasks):
            raise ValueError(f"no task {index!r}: the taskset has {len(self.tasks)}")
        return self.tasks[index]

    def describe(self, index: int, task: Any) -> dict[str, Any]:
        data = task.data.model_dump(mode="json", exclude_none=True)
        return {
            "index": index,
            "key": str(getattr(task, "key", index)),
            "prompt": data.get("prompt"),
            "system_prompt": data.get("system_prompt"),
            "answer": data.get("answer"),
            "data": data,
        }

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        vf = self.vf
        task = self.task(request)
        variable = f"{KEY_VARIABLE}{next(self.counter)}"
        os.environ[variable] = request["api_key"]
        sampling = {k: v for k, v in (request.get("sampling") or {}).items() if v is not None}
        try:
            context = vf.ModelContext(
                model=request.get("model") or "policy",
                client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var=variable),
                sampling=vf.SamplingConfig(**sampling),
            )
            episode = await self.env.run_episode(task, context)
        finally:
            os.environ.pop(variable, None)
        errors = [{"type": e.type, "message": e.message} for e in episode.errors]
        if not episode.traces:
            return {"reward": 0.0, "rewards": {}, "ok": False, "errors": errors,
                    "stop_condition": None, "num_turns": 0, "messages": []}  # fmt: skip
        trace = episode.traces[-1]
        errors += [{"type": e.type, "message": e.message} for e in trace.errors]
        return {
            "reward": float(trace.reward),
            "rewards": rewards_of(trace),
            "ok": bool(episode.ok and trace.ok),
            "errors": errors,
            "stop_condition": None if trace.stop_condition is None else str(trace.stop_condition),
            "num_turns": int(trace.num_turns),
            "messages": [m.model_dump(mode="json", exclude_none=True) for m in trace.messages],
        }

    async def score(self, request: dict[str, Any]) -> dict[str, Any]:
        """The task's own rubric on a transcript (OpenAI chat messages), as one branch whose
        assistant messages were sampled; rewards that need the runtime are skipped."""
        from verifiers.v1.dialects.chat import parse_message
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        vf = self.vf
        task = self.task(request)
        nodes = []
        for i, raw in enumerate(request["messages"]):
            message = parse_message(raw)
            sampled = message.role == "assistant"
            nodes.append(MessageNode(parent=i - 1 if i else None, message=message, sampled=sampled))
        trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
        )
        await task.score(trace)
        return {"reward": float(trace.reward), "rewards": rewards_of(trace)}


def rewards_of(trace: Any) -> dict[str, dict[str, float]]:
    return {
        name: {"score": float(value.score), "weight": float(value.weight)}
        for name, value in trace.rewards.items()
        if value is not None
    }


def run_uv_scripts_with_this_python() -> None:
    """verifiers' subprocess runtime prepares a harness's PEP 723 program with ``uv sync
    --script`` (uv and an index on first use); run it with this interpreter instead, whose
    venv has the program's dependencies (verifiers' own: openai, mcp, httpx)."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    async def prepare_uv_script(
        self: Any, script: str | bytes, env: Any = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        directory = str(self.scripts_dir)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, hashlib.sha256(data).hexdigest() + ".py")
        if not os.path.exists(path):
            partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(partial, "wb") as file:
                file.write(data)
            os.replace(partial, path)
        return [sys.executable, path]

    SubprocessRuntime.prepare_uv_script = prepare_uv_script


if __name__ == "__main__":
    sys.exit(main(sys.argv))
