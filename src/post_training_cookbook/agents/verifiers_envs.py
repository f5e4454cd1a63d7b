"""Train (or evaluate) a ``verifiers`` environment as it is: its dataset, its rollout and its
rubric, through the policy server.

    with VerifiersEnvs("reverse_text") as env_factory:
        tasks = env_factory.tasks()
        train_multi_turn(config, tasks, env_factory)

verifiers pins versions of ``openai`` and ``mcp`` that clash with ours, so it runs in a venv of
its own (``scripts/verifiers_venv.sh`` builds ``.venv-verifiers``), in one worker process per
``VerifiersEnvs`` (``verifiers_worker.py``, which imports nothing of this package; JSON lines
on its stdin and stdout). The worker loads the taskset and plays each episode with verifiers'
own ``SingleAgentEnv`` (the ``null`` harness: the taskset's prompt, its MCP tools, its stop
hooks), whose model is this episode's route on the policy server. So an episode is an
``AgentEnvs`` episode whose agent is verifiers: its tokens are exactly what the server sampled,
split into segments as ``agents/episode.py`` says, and its reward is what the task's rubric
gave the rollout (the rubric's parts are the episode's ``verifiers_<name>`` metrics).

A rollout that verifiers reports errors for (a tool server that failed, a provider error,
a hook that raised) is an env error under the run's ``env_errors`` policy, unless the policy
server ended the episode first (``max_turns``, the context, a reply that did not parse), which
ends it as ``AgentEnvs`` does. docs/verifiers.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from post_training_cookbook.agents.env import (
    MODEL_NAME,
    AgentEnv,
    AgentEnvs,
    _run_agent,
)
from post_training_cookbook.envs.base import Task
from post_training_cookbook.rollout.guards import EnvFault
from post_training_cookbook.types import Message

WORKER = Path(__file__).with_name("verifiers_worker.py")
PYTHON_VARIABLE = "POST_TRAINING_COOKBOOK_VERIFIERS_PYTHON"
"""Names the verifiers venv's interpreter when ``VerifiersEnvs(python=...)`` does not."""
VENV = ".venv-verifiers"
HOW_TO_BUILD = (
    "build it with `bash scripts/verifiers_venv.sh` (a venv at .venv-verifiers with "
    "requirements/verifiers.txt), then pass VerifiersEnvs(python=...) or set "
    f"{PYTHON_VARIABLE} when it is not ./.venv-verifiers/bin/python"
)
TASK_INDEX = "verifiers_task"
"""The ``Task.metadata`` key of a task's index in its taskset."""


class VerifiersUnavailable(RuntimeError):
    """No interpreter with verifiers to run the worker with (raised before any model loads)."""


class VerifiersError(RuntimeError):
    """The worker failed a request, or died."""


def verifiers_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter of the verifiers venv: ``python``, else the one
    ``$POST_TRAINING_COOKBOOK_VERIFIERS_PYTHON`` names, else ``.venv-verifiers/bin/python`` in
    the working directory or the repository."""
    named = python if python is not None else os.environ.get(PYTHON_VARIABLE)
    if named:
        path = Path(named)
        if not path.exists():
            raise VerifiersUnavailable(f"no verifiers interpreter at {path}: {HOW_TO_BUILD}")
        return path
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        candidate = root / VENV / "bin" / "python"
        if candidate.exists():
            return candidate
    raise VerifiersUnavailable(f"no verifiers venv ({VENV}/bin/python): {HOW_TO_BUILD}")


@dataclass(frozen=True)
class Scored:
    """A transcript as the task's rubric scores it."""

    reward: float
    rewards: dict[str, float]
    """Each reward function's score (the reward is their weighted sum)."""


class VerifiersEnvs(AgentEnvs):
    """The env factory of a verifiers taskset: ``env_factory=VerifiersEnvs("reverse_text")``.

    ``taskset``: the taskset's id (a module the verifiers venv imports), or verifiers'
    ``TasksetConfig`` as a dict (``{"id": ..., <its fields>}``). ``paths`` go first on the
    worker's ``sys.path`` (an env package not installed in the venv); ``max_turns`` is
    verifiers' agent limit (keep it at most the run's ``max_turns``, whose next call the server
    refuses); ``max_tokens`` what verifiers asks per call (the run's ``max_tokens_per_turn``
    caps it); ``uv``: let verifiers prepare its harness program with ``uv sync`` (needs uv and
    an index) rather than run it with the venv's interpreter; ``worker_env``: environment
    variables for the worker, over this process's. The worker starts here, so that a missing
    venv or a taskset that does not load fails before any model loads.
    ``max_concurrent_agents`` bounds the rollouts running at once (in each event loop): each
    starts verifiers' harness program, a Python process of ~90 MB."""

    def __init__(
        self,
        taskset: str | Mapping[str, Any],
        *,
        python: str | os.PathLike[str] | None = None,
        paths: Sequence[str | os.PathLike[str]] = (),
        max_turns: int | None = None,
        max_tokens: int | None = None,
        uv: bool = False,
        worker_env: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        max_concurrent_agents: int = 64,
    ) -> None:
        super().__init__(
            _unused_agent, timeout_s=timeout_s, max_concurrent_agents=max_concurrent_agents
        )
        config = {"id": taskset} if isinstance(taskset, str) else dict(taskset)
        if not isinstance(config.get("id"), str) or not config["id"]:
            raise ValueError("taskset must be a taskset id, or a dict with one under 'id'")
        if any(limit is not None and limit < 1 for limit in (max_turns, max_tokens)):
            raise ValueError("max_turns and max_tokens must be >= 1 when given")
        self.python = verifiers_python(python)
        self.max_tokens = max_tokens
        worker_config = {
            "taskset": config,
            "max_turns": max_turns,
            "paths": [str(Path(p).resolve()) for p in paths],
            "uv": uv,
        }
        env = {**os.environ, **(worker_env or {})}
        self.worker = _Worker(self.python, worker_config, env, start_timeout_s)
        self._tasks: list[Task] | None = None
        self._rollout_slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def rollout_slots(self) -> asyncio.Semaphore:
        """The running loop's bound on rollouts at once: the rollouts are coroutines, which
        ``AgentEnvs``' thread pool (its bound on sync agents) never sees."""
        loop = asyncio.get_running_loop()
        if loop not in self._rollout_slots:
            live = {known: slots for known, slots in self._rollout_slots.items()
                    if not known.is_closed()}  # fmt: skip
            self._rollout_slots = live
            self._rollout_slots[loop] = asyncio.Semaphore(self.max_concurrent_agents)
        return self._rollout_slots[loop]

    def __call__(self, task: Task) -> VerifiersEnv:
        return VerifiersEnv(self)

    def tasks(self) -> list[Task]:
        """The taskset's tasks, in its order: ``prompt`` (the user prompt; JSON when it is a
        list of messages), ``target`` (the task's ``answer``, if it has one), and ``metadata``
        with the task's index (``verifiers_task``), key and data."""
        if self._tasks is None:
            described = self.worker.call("tasks")
            self._tasks = [
                Task(
                    prompt=t["prompt"] if isinstance(t["prompt"], str) else json.dumps(t["prompt"]),
                    target="" if t.get("answer") is None else str(t["answer"]),
                    metadata={TASK_INDEX: t["index"], "verifiers_key": t["key"], **t["data"]},
                )
                for t in described
            ]
        return list(self._tasks)

    def score(self, task: Task, messages: Sequence[Message]) -> Scored:
        """The task's own rubric on a transcript (OpenAI chat messages), offline: rewards that
        need the rollout's runtime are skipped."""
        answer = self.worker.call("score", task=task_index(task), messages=list(messages))
        return _scored(answer)

    async def run_rollout(self, base_url: str, api_key: str, task: Task) -> dict[str, Any]:
        """One verifiers rollout of ``task`` against ``base_url``: the worker's answer."""
        pending = self.worker.request(
            "run",
            task=task_index(task),
            base_url=base_url,
            api_key=api_key,
            model=MODEL_NAME,
            sampling={"max_tokens": self.max_tokens},
        )
        answer: dict[str, Any] = await asyncio.wrap_future(pending)
        return answer

    def close(self) -> None:
        self.worker.close()
        super().close()


class VerifiersEnv(AgentEnv):
    """One episode: a verifiers rollout against this episode's route."""

    envs: VerifiersEnvs

    def __init__(self, envs: VerifiersEnvs) -> None:
        super().__init__(envs)
        self.rollout: dict[str, Any] | None = None

    async def run_agent(
        self, base_url: str, api_key: str, task: Task
    ) -> tuple[Any, EnvFault | None]:
        async def rollout(base_url: str, api_key: str, task: Task) -> float:
            answer = await self.envs.run_rollout(base_url, api_key, task)
            self.rollout = answer
            if answer["errors"] or not answer["ok"]:
                said = "; ".join(f"{e['type']}: {e['message'][:300]}" for e in answer["errors"])
                stop = answer.get("stop_condition")
                raise VerifiersError(f"the verifiers rollout failed ({stop}): {said}")
            return float(answer["reward"])

        async with self.envs.rollout_slots():  # waiting for a slot is not the rollout's time
            return await _run_agent(self.envs, base_url, api_key, task, agent=rollout)

    def episode_metrics(self) -> dict[str, float]:
        if self.rollout is None:
            return {}
        return {f"verifiers_{k}": float(v["score"]) for k, v in self.rollout["rewards"].items()}


def task_index(task: Task) -> int:
    index = task.metadata.get(TASK_INDEX)
    if not isinstance(index, int) or isinstance(index, bool):
        raise EnvFault(
            f"the task has no {TASK_INDEX!r} in its metadata: take tasks from VerifiersEnvs.tasks()"
        )
    return index


def _scored(answer: dict[str, Any]) -> Scored:
    rewards = {name: float(part["score"]) for name, part in answer["rewards"].items()}
    return Scored(float(answer["reward"]), rewards)


def _unused_agent(base_url: str, api_key: str, task: Task) -> float:
    raise RuntimeError("VerifiersEnvs episodes run verifiers' rollout, not an agent")


class _Worker:
    """The worker process: requests by id, answered concurrently, as futures."""

    def __init__(
        self, python: Path, config: dict[str, Any], env: dict[str, str], start_timeout_s: float
    ) -> None:
        self.process = subprocess.Popen(
            [str(python), str(WORKER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            env=env,
            start_new_session=True,  # its group: verifiers' processes go with it on close
        )
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.pending: dict[int, Future[Any]] = {}
        self.ready: Future[Any] = Future()
        self.ids = itertools.count()
        self.lock = threading.Lock()
        threading.Thread(target=self._read_stderr, daemon=True, name="verifiers-err").start()
        threading.Thread(target=self._read_answers, daemon=True, name="verifiers-out").start()
        try:
            self.info = self.ready.result(timeout=start_timeout_s)
        except TimeoutError:
            self.close()
            raise VerifiersError(
                f"the verifiers worker did not load the taskset within {start_timeout_s:g}s"
                + self._tail()
            ) from None
        except Exception:
            self.close()
            raise

    def request(self, op: str, **fields: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self.lock:
            if self.process.poll() is not None or self.process.stdin is None:
                future.set_exception(
                    VerifiersError("the verifiers worker has ended" + self._tail())
                )
                return future
            request_id = next(self.ids)
            self.pending[request_id] = future
            try:
                self.process.stdin.write(json.dumps({"id": request_id, "op": op, **fields}) + "\n")
                self.process.stdin.flush()
            except OSError as exc:
                self.pending.pop(request_id, None)
                future.set_exception(VerifiersError(f"the verifiers worker is gone: {exc}"))
        return future

    def call(self, op: str, timeout_s: float = 600.0, **fields: Any) -> Any:
        return self.request(op, **fields).result(timeout=timeout_s)

    def close(self) -> None:
        with self.lock:
            if self.process.stdin is not None and not self.process.stdin.closed:
                with contextlib.suppress(OSError):
                    self.process.stdin.close()
        try:
            self.process.wait(timeout=10)  # it finishes the requests it has, then ends
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _read_answers(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                self.stderr_tail.append(line)
                continue
            if "ready" in answer:
                self.ready.set_result(answer["ready"])
            elif "fatal" in answer:
                error = VerifiersError(f"the verifiers worker failed to start:\n{answer['fatal']}")
                self.ready.set_exception(error)
            else:
                with self.lock:
                    future = self.pending.pop(answer.get("id"), None)
                if future is None or future.done():
                    continue
                if "error" in answer:
                    future.set_exception(VerifiersError(answer["error"]))
                else:
                    future.set_result(answer["result"])
        self.process.wait()
        ended = VerifiersError(
            f"the verifiers worker ended (exit code {self.process.returncode})" + self._tail()
        )
        if not self.ready.done():
            self.ready.set_exception(ended)
        with self.lock:
            pending, self.pending = list(self.pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(ended)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip("\n"))

    def _tail(self) -> str:
        lines = list(self.stderr_tail)[-20:]
        return ("; its last stderr lines:\n" + "\n".join(lines)) if lines else ""
