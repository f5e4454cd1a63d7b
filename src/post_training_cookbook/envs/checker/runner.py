"""``check_env`` and ``acheck_env``: drive each script's episode on each task, under timeouts."""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from post_training_cookbook.envs.base import Env, StepResult, Task, env_class_parameters
from post_training_cookbook.envs.checker.checks import (
    _check_history,
    _check_messages,
    _check_result_fields,
    _check_returns_copy,
    _check_tool_specs,
    _difference,
    _number_problem,
)
from post_training_cookbook.envs.checker.report import (
    INTERMEDIATE_REWARD_NOTE,
    EnvCheckReport,
    _Findings,
    _Recorder,
)
from post_training_cookbook.envs.checker.scripts import _SCRIPTS, _ScriptContext
from post_training_cookbook.envs.mixture import EnvMixture
from post_training_cookbook.stretches import with_longest_stretch
from post_training_cookbook.sync import run_sync
from post_training_cookbook.types import Message

BLOCKING_WARNING_S = 0.25
"""An env call that runs this long without yielding gets a warning (an error past the
step timeout): the training loop's other episodes wait for it."""


def check_env(
    env_factory: Callable[[Task], Env] | EnvMixture,
    tasks: Sequence[Task] | None = None,
    *,
    num_tasks: int = 3,
    max_turns: int = 12,
    step_timeout_s: float = 10.0,
) -> EnvCheckReport:
    """Run scripted episodes on the first ``num_tasks`` tasks and report what breaks the contract.

    ``env_factory`` may be an ``EnvMixture`` (without ``tasks``): each of its envs is checked
    on the first ``num_tasks`` of its own tasks, and each line names the env. ``max_turns``
    bounds the longest script; ``step_timeout_s`` bounds each ``reset``, ``step`` and
    ``close``. Callable from sync code, including inside a running event loop (a notebook).
    """
    coroutine = acheck_env(
        env_factory,
        tasks,
        num_tasks=num_tasks,
        max_turns=max_turns,
        step_timeout_s=step_timeout_s,
    )
    return run_sync(coroutine)


async def acheck_env(
    env_factory: Callable[[Task], Env] | EnvMixture,
    tasks: Sequence[Task] | None = None,
    *,
    num_tasks: int = 3,
    max_turns: int = 12,
    step_timeout_s: float = 10.0,
) -> EnvCheckReport:
    """``check_env`` for async callers."""
    if isinstance(env_factory, EnvMixture):
        if tasks is not None:
            raise ValueError("check_env(mixture) checks each env on its own tasks: drop tasks")
        return await _check_mixture(env_factory, num_tasks, max_turns, step_timeout_s)
    if not tasks:
        raise ValueError("check_env needs at least one task")
    if num_tasks < 1 or max_turns < 1 or not step_timeout_s > 0:
        raise ValueError(
            f"num_tasks and max_turns must be >= 1 and step_timeout_s > 0, got "
            f"num_tasks={num_tasks}, max_turns={max_turns}, step_timeout_s={step_timeout_s}"
        )
    findings = _Findings()
    chosen_tasks = list(tasks)[:num_tasks]
    episodes_run = 0
    for task_index, task in enumerate(chosen_tasks):
        for script, build in _SCRIPTS.items():
            env = _build_env(env_factory, task, task_index, findings)
            if env is None:
                continue
            episodes_run += 1
            episode = _Episode(env, task, task_index, script, findings, step_timeout_s)
            await episode.run(build, max_turns)
    return findings.report(len(chosen_tasks), episodes_run)


async def _check_mixture(
    mixture: EnvMixture, num_tasks: int, max_turns: int, step_timeout_s: float
) -> EnvCheckReport:
    """Each env of the mixture on its own tasks, in one report whose lines name the env."""
    merged = EnvCheckReport()
    for entry in mixture.entries:
        report = await acheck_env(
            entry.env_factory,
            entry.tasks,
            num_tasks=num_tasks,
            max_turns=max_turns,
            step_timeout_s=step_timeout_s,
        )
        merged.errors += [f"env {entry.name!r} {line}" for line in report.errors]
        merged.warnings += [f"env {entry.name!r} {line}" for line in report.warnings]
        merged.episodes_run += report.episodes_run
    return merged


def _build_env(
    env_factory: Callable[[Task], Env], task: Task, task_index: int, findings: _Findings
) -> Env | None:
    mistake = _class_as_factory(env_factory)
    if mistake:
        findings.add("error", "env_factory", mistake, task_index)
    try:
        env = env_factory(task)
    except Exception as exc:
        findings.add("error", "env_factory", f"env_factory(task) raised {exc!r}", task_index)
        return None
    if not isinstance(env, Env):
        text = f"env_factory returned a {type(env).__name__}, which does not subclass Env"
        findings.add("warning", "env_factory", text, task_index)
    return env


def _class_as_factory(env_factory: Callable[[Task], Env]) -> str | None:
    """The env class passed where a factory was meant: ``env_factory(task)`` then hands the
    Task to the class's first parameter (unless that parameter is meant to take one)."""
    parameters = env_class_parameters(env_factory)
    if parameters is None:
        return None
    first = parameters[0] if parameters else None
    if first is not None and (first.name == "task" or first.annotation in (Task, "Task")):
        return None
    name = env_factory.__name__
    given = f"its first parameter {first.name!r}" if first else "a class that takes none"
    return (
        f"env_factory is the class {name} itself: the loop calls env_factory(task), which "
        f"hands the Task to {given}; pass a factory that builds a fresh env, e.g. "
        f"env_factory=lambda task: {name}()"
    )


class _Episode:
    """One scripted episode on a fresh env, recording every violation it sees."""

    def __init__(
        self,
        env: Env,
        task: Task,
        task_index: int,
        script: str,
        findings: _Findings,
        timeout_s: float,
    ) -> None:
        self._env, self._task = env, task
        self._script, self._timeout_s = script, timeout_s
        self._record = _Recorder(findings, task_index)

    async def run(self, build: Callable[[_ScriptContext], list[Message]], max_turns: int) -> None:
        steps_taken = 0
        try:
            if not await self._reset():
                return
            tools = _check_tool_specs(self._record, self._env)
            for turn, message in enumerate(build(_ScriptContext(self._task, tools, max_turns)), 1):
                steps_taken += 1
                if not await self._step(turn, message):
                    break
        finally:
            # The loop closes every episode, however it ended.
            await self._close("close" if steps_taken else "close right after reset")

    async def _call(
        self, where: str, what: str, start: Callable[[], Any], consequence: str
    ) -> tuple[bool, Any]:
        """Await one env coroutine under the timeout: (True, value), or (False, None) after
        recording why it failed."""
        timeout = asyncio.timeout(self._timeout_s)
        try:
            awaitable = start()
            if not inspect.isawaitable(awaitable):
                got = type(awaitable).__name__
                self._record.error(
                    where, f"{what} returned a {got}, not an awaitable; define it with async def"
                )
                return False, None
            async with timeout:
                value, blocked_s = await with_longest_stretch(awaitable)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and timeout.expired():
                limit = f"step_timeout_s={self._timeout_s:g}s"
                self._record.error(
                    where,
                    f"{what} did not finish within {limit}; a hung {what} stalls the training run",
                )
            else:
                self._record.error(where, f"{what} raised {exc!r}; {consequence}")
            return False, None
        if blocked_s > min(self._timeout_s, BLOCKING_WARNING_S):
            past_timeout = blocked_s > self._timeout_s
            record = self._record.error if past_timeout else self._record.warn
            bound = (
                f"step_timeout_s={self._timeout_s:g}s"
                if past_timeout
                else (f"{BLOCKING_WARNING_S:g}s")
            )
            record(
                where,
                f"{what} blocked the event loop for over {bound} without yielding (a "
                "blocking call in async code, e.g. time.sleep or heavy work): every episode of "
                "a training run waits meanwhile; await instead, or use asyncio.to_thread",
            )
        return True, value

    def _history(self, where: str) -> list[Message] | None:
        try:
            history = self._env.messages
        except Exception as exc:
            self._record.error(where, f"env.messages raised {exc!r}")
            return None
        if not isinstance(history, list):
            self._record.error(
                where, f"env.messages is a {type(history).__name__}, not a list of messages"
            )
            return None
        return history

    async def _reset(self) -> bool:
        ok, opening = await self._call(
            "reset",
            "reset",
            lambda: self._env.reset(self._task),
            "an exception escaping reset stops the training run",
        )
        if not ok:
            return False
        if not isinstance(opening, list):
            got = type(opening).__name__
            self._record.error("reset", f"reset returned a {got}, not a list of messages")
            return False
        if not opening:
            self._record.error(
                "reset", "reset returned no messages; return the opening ones (system, user, ...)"
            )
        _check_messages(self._record, "reset", "reset's return value", opening)
        history = self._history("reset")
        if history is None:
            return False
        if history != opening:
            self._record.error(
                "reset",
                f"reset's return value differs from env.messages ({_difference(opening, history)})",
            )
        _check_returns_copy(self._record, self._env, copy.deepcopy(history), opening)
        return True

    async def _step(self, turn: int, message: Message) -> bool:
        """Send one scripted message and check the reply; True while the episode goes on."""
        where = f"script {self._script!r}, turn {turn}"
        before = self._history(where)
        if before is None:
            return False
        before = copy.deepcopy(before)
        has_calls = bool(message.get("tool_calls"))
        consequence = "an exception escaping step stops the training run"
        if has_calls:
            consequence += " — return a tool message instead"
        sent = copy.deepcopy(message)  # the env may keep and mutate what it is given
        ok, result = await self._call(where, "step", lambda: self._env.step(sent), consequence)
        if not ok:
            return False
        if not isinstance(result, StepResult):
            self._record.error(where, f"step returned a {type(result).__name__}, not a StepResult")
            return False
        ended = _check_result_fields(self._record, where, result)
        history = self._history(where)
        if history is None:
            return False
        _check_history(self._record, where, before, message, result, history, ended)
        if not ended and _number_problem(result.reward) is None and result.reward != 0:
            self._record.note(where, INTERMEDIATE_REWARD_NOTE)
        if not has_calls and not ended:
            self._record.warn(
                where,
                "a final answer (an assistant message without tool calls) did not end the "
                "episode; the cookbook's envs return terminated=True for it, otherwise the loop "
                "runs on to max_turns",
            )
        return not ended

    async def _close(self, where: str) -> None:
        ok, _ = await self._call(
            where,
            "close",
            lambda: self._env.close(),
            "the loop closes every episode, so this stops the training run",
        )
        if ok:
            await self._call(
                where,
                "a second close",
                lambda: self._env.close(),
                "close is not idempotent; make later calls no-ops",
            )
