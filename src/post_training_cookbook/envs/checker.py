"""``check_env``: drive an environment with scripted episodes and report contract violations.

Like gymnasium's env checker, run it once on your env before you train::

    report = check_env(lambda task: MathEnv(), tasks)
    print(report)
    report.raise_if_failed()

Each scripted episode runs on a fresh env from ``env_factory(task)``: a right and a wrong final
answer, a valid tool call, an unknown tool, malformed arguments, several calls in one message,
many turns of tool calls, and a close right after reset. Every reply is checked against the
contract in ``envs/base.py``. ``errors`` break or corrupt a training run (an exception escaping
``step``, a tool call left unanswered, a NaN reward); ``warnings`` are departures from the
cookbook's conventions that a run survives. Each violation is reported once, where it was
first seen, with the count of other places that saw it; one seen on only some of the tasks
names them (``task 0`` is ``tasks[0]``).

``step`` after the episode ended is not exercised: the loop never calls it. The timeout cancels
a ``step`` that awaits too long; one that blocks the event loop (``time.sleep`` in async code)
cannot be interrupted, and is reported as too slow once it returns.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import json
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from post_training_cookbook.envs.base import Env, StepResult, Task
from post_training_cookbook.types import Message, ToolCall

VALID_ROLES = ("system", "user", "assistant", "tool")
UNKNOWN_TOOL_NAME = "check_env_no_such_tool"
MALFORMED_ARGUMENTS = '{"arguments": not json'
WRONG_ANSWER = "check_env: a deliberately wrong answer"


class EnvCheckError(AssertionError):
    """Raised by ``EnvCheckReport.raise_if_failed``.

    An ``AssertionError``, as gymnasium's checker raises, so that a test calling it fails
    rather than errors. The message is the whole report.
    """

    def __init__(self, report: EnvCheckReport) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass
class EnvCheckReport:
    """What ``check_env`` found; each line reads ``[where]: what went wrong and what to do``."""

    errors: list[str] = field(default_factory=list)
    """Contract violations that break or corrupt a training run."""
    warnings: list[str] = field(default_factory=list)
    """Departures from the cookbook's conventions that a training run survives."""
    episodes_run: int = 0

    @property
    def ok(self) -> bool:
        """True when there are no errors (warnings allowed)."""
        return not self.errors

    def __str__(self) -> str:
        counts = f"{_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"
        lines = [f"check_env: {counts} in {_plural(self.episodes_run, 'episode')}"]
        lines += [f"  ERROR {error}" for error in self.errors]
        lines += [f"  WARNING {warning}" for warning in self.warnings]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise ``EnvCheckError`` with this report as its message when there are errors."""
        if self.errors:
            raise EnvCheckError(self)


def check_env(
    env_factory: Callable[[Task], Env],
    tasks: Sequence[Task],
    *,
    num_tasks: int = 3,
    max_turns: int = 12,
    step_timeout_s: float = 10.0,
) -> EnvCheckReport:
    """Run scripted episodes on the first ``num_tasks`` tasks and report what breaks the contract.

    ``max_turns`` bounds the longest script; ``step_timeout_s`` bounds each ``reset``, ``step``
    and ``close``. Callable from sync code, including inside a running event loop (a notebook).
    """
    coroutine = acheck_env(
        env_factory,
        tasks,
        num_tasks=num_tasks,
        max_turns=max_turns,
        step_timeout_s=step_timeout_s,
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # asyncio.run refuses to start inside a running loop, so give the check a thread of its own.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def acheck_env(
    env_factory: Callable[[Task], Env],
    tasks: Sequence[Task],
    *,
    num_tasks: int = 3,
    max_turns: int = 12,
    step_timeout_s: float = 10.0,
) -> EnvCheckReport:
    """``check_env`` for async callers."""
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


# --- Scripts: the assistant messages each scripted episode sends, in order ----------------------


@dataclass
class _ScriptContext:
    task: Task
    tools: list[tuple[str, Any]]
    """(name, parameters schema) of each tool spec with a usable name."""
    max_turns: int
    call_numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def call(self, name: str, arguments: str) -> ToolCall:
        """A tool call with an id unique within the episode."""
        call_id = f"call_check_{next(self.call_numbers)}"
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def valid_call(self, index: int) -> ToolCall:
        """A call to the ``index``-th tool (cycling) with arguments made from its schema."""
        name, schema = self.tools[index % len(self.tools)]
        return self.call(name, json.dumps(_example_arguments(schema)))

    def answer(self, content: str | None = None) -> Message:
        """A final answer: an assistant message without tool calls (the target by default)."""
        return Message(
            role="assistant", content=str(self.task.target) if content is None else content
        )


def _calls(*tool_calls: ToolCall) -> Message:
    return Message(role="assistant", content="", tool_calls=list(tool_calls))


def _tool_call(ctx: _ScriptContext) -> list[Message]:
    return [_calls(ctx.valid_call(0)), ctx.answer()] if ctx.tools else []


def _unknown_tool(ctx: _ScriptContext) -> list[Message]:
    return [_calls(ctx.call(UNKNOWN_TOOL_NAME, "{}")), ctx.answer()]


def _malformed_arguments(ctx: _ScriptContext) -> list[Message]:
    name = ctx.tools[0][0] if ctx.tools else UNKNOWN_TOOL_NAME
    return [_calls(ctx.call(name, MALFORMED_ARGUMENTS)), ctx.answer()]


def _several_tool_calls(ctx: _ScriptContext) -> list[Message]:
    count = min(max(2, len(ctx.tools)), 3)
    return [_calls(*(ctx.valid_call(i) for i in range(count))), ctx.answer()] if ctx.tools else []


def _many_turns(ctx: _ScriptContext) -> list[Message]:
    return [_calls(ctx.valid_call(turn)) for turn in range(ctx.max_turns)] if ctx.tools else []


# Scripts needing a tool send nothing to a tool-less env, which is then only reset and closed.
_SCRIPTS: dict[str, Callable[[_ScriptContext], list[Message]]] = {
    "final answer": lambda ctx: [ctx.answer()],
    "wrong answer": lambda ctx: [ctx.answer(WRONG_ANSWER)],
    "tool call": _tool_call,
    "unknown tool": _unknown_tool,
    "malformed arguments": _malformed_arguments,
    "several tool calls": _several_tool_calls,
    "many turns": _many_turns,
    "reset then close": lambda ctx: [],
}


def _example_arguments(schema: Any) -> dict[str, Any]:
    """The required properties of an object schema, each filled with a type-appropriate value."""
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    names = (
        [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
    )
    return {name: _example_value(properties.get(name)) for name in names}


_EXAMPLE_BY_TYPE: dict[str, Any] = {
    "string": "example",
    "integer": 1,
    "number": 1.5,
    "boolean": True,
    "null": None,
}


def _example_value(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return "example"
    if "const" in schema:
        return schema["const"]
    for key in ("enum", "examples", "anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _example_value(options[0]) if key.endswith("Of") else options[0]
    if "default" in schema:
        return schema["default"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return _example_arguments(schema)
    if kind == "array":
        return [_example_value(schema["items"])] if isinstance(schema.get("items"), dict) else []
    if kind in ("integer", "number") and isinstance(schema.get("minimum"), int | float):
        return schema["minimum"]
    return _EXAMPLE_BY_TYPE.get(kind, "example") if isinstance(kind, str) else "example"


# --- Findings: violations collected across episodes -------------------------------------------

Level = Literal["error", "warning"]


@dataclass
class _Places:
    wheres: list[str] = field(default_factory=list)
    task_indices: list[int] = field(default_factory=list)


class _Findings:
    """Violations of every episode. One seen in several places is reported once, at the first."""

    def __init__(self) -> None:
        self._places: dict[tuple[Level, str], _Places] = {}

    def add(self, level: Level, where: str, text: str, task_index: int) -> None:
        places = self._places.setdefault((level, text), _Places())
        if where not in places.wheres:
            places.wheres.append(where)
        if task_index not in places.task_indices:
            places.task_indices.append(task_index)

    def report(self, task_count: int, episodes_run: int) -> EnvCheckReport:
        report = EnvCheckReport(episodes_run=episodes_run)
        for (level, text), places in self._places.items():
            lines = report.errors if level == "error" else report.warnings
            lines.append(f"[{_location(places, task_count)}]: {text}")
        return report


def _location(places: _Places, task_count: int) -> str:
    location = places.wheres[0]
    if len(places.wheres) > 1:
        location += f" (and {len(places.wheres) - 1} more)"
    task_indices = places.task_indices
    if len(task_indices) < task_count:
        location += f", task{'s' if len(task_indices) > 1 else ''} "
        location += ", ".join(map(str, task_indices))
    return location


def _build_env(
    env_factory: Callable[[Task], Env], task: Task, task_index: int, findings: _Findings
) -> Env | None:
    try:
        env = env_factory(task)
    except Exception as exc:
        findings.add("error", "env_factory", f"env_factory(task) raised {exc!r}", task_index)
        return None
    if not isinstance(env, Env):
        text = f"env_factory returned a {type(env).__name__}, which does not subclass Env"
        findings.add("warning", "env_factory", text, task_index)
    return env


# --- One scripted episode ---------------------------------------------------------------------


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
        self._env, self._task, self._task_index = env, task, task_index
        self._script, self._findings, self._timeout_s = script, findings, timeout_s

    def _error(self, where: str, text: str) -> None:
        self._findings.add("error", where, text, self._task_index)

    def _warn(self, where: str, text: str) -> None:
        self._findings.add("warning", where, text, self._task_index)

    async def run(self, build: Callable[[_ScriptContext], list[Message]], max_turns: int) -> None:
        steps_taken = 0
        try:
            if not await self._reset():
                return
            tools = self._check_tool_specs()
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
        began = time.monotonic()
        timeout = asyncio.timeout(self._timeout_s)
        try:
            awaitable = start()
            if not inspect.isawaitable(awaitable):
                got = type(awaitable).__name__
                self._error(
                    where, f"{what} returned a {got}, not an awaitable; define it with async def"
                )
                return False, None
            async with timeout:
                value = await awaitable
        except Exception as exc:
            if isinstance(exc, TimeoutError) and timeout.expired():
                limit = f"step_timeout_s={self._timeout_s:g}s"
                self._error(
                    where,
                    f"{what} did not finish within {limit}; a hung {what} stalls the training run",
                )
            else:
                self._error(where, f"{what} raised {exc!r}; {consequence}")
            return False, None
        elapsed = time.monotonic() - began
        if elapsed > self._timeout_s:
            self._error(
                where,
                f"{what} ran past step_timeout_s={self._timeout_s:g}s without "
                "yielding to the event loop (a blocking call in async code); "
                "it stalls the training run",
            )
        return True, value

    def _history(self, where: str) -> list[Message] | None:
        try:
            history = self._env.messages
        except Exception as exc:
            self._error(where, f"env.messages raised {exc!r}")
            return None
        if not isinstance(history, list):
            self._error(
                where, f"env.messages is a {type(history).__name__}, not a list of messages"
            )
            return None
        return history

    def _check_messages(self, where: str, source: str, messages: list[Any], first: int = 0) -> None:
        for index, message in enumerate(messages, first):
            problem = _message_problem(message)
            if problem:
                self._error(where, f"message {index} of {source} {problem}")

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
            self._error("reset", f"reset returned a {got}, not a list of messages")
            return False
        if not opening:
            self._error(
                "reset", "reset returned no messages; return the opening ones (system, user, ...)"
            )
        self._check_messages("reset", "reset's return value", opening)
        history = self._history("reset")
        if history is None:
            return False
        if history != opening:
            self._error(
                "reset",
                f"reset's return value differs from env.messages ({_difference(opening, history)})",
            )
        self._check_returns_copy(copy.deepcopy(history), opening)
        return True

    def _check_returns_copy(self, history: list[Message], opening: list[Message]) -> None:
        opening.append(Message(role="user", content="check_env probe"))
        try:
            aliased = self._env.messages != history
        finally:
            opening.pop()  # restore the env's history if it was aliased
        if aliased:
            self._error(
                "reset",
                "reset returned the env's own history list: appending to the returned list "
                "changed env.messages; return a copy (list(self._messages))",
            )

    def _check_tool_specs(self) -> list[tuple[str, Any]]:
        """Record what is wrong with ``env.tool_specs``; the usable (name, schema) pairs."""
        try:
            specs = self._env.tool_specs
        except Exception as exc:
            self._error("tool_specs", f"env.tool_specs raised {exc!r}")
            return []
        if not isinstance(specs, list):
            self._error("tool_specs", f"env.tool_specs is a {type(specs).__name__}, not a list")
            return []
        tools = []
        for index, spec in enumerate(specs):
            for problem in _tool_spec_problems(spec):
                self._error("tool_specs", f"tool_specs[{index}] {problem}")
            function = spec.get("function") if isinstance(spec, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                tools.append((function["name"], function.get("parameters")))
        repeated = sorted(name for name, count in Counter(n for n, _ in tools).items() if count > 1)
        if repeated:
            self._error("tool_specs", f"tool names must be unique; repeated: {', '.join(repeated)}")
        return tools

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
            self._error(where, f"step returned a {type(result).__name__}, not a StepResult")
            return False
        ended = self._check_result_fields(where, result)
        history = self._history(where)
        if history is None:
            return False
        self._check_history(where, before, message, result, history, ended)
        if not has_calls and not ended:
            self._warn(
                where,
                "a final answer (an assistant message without tool calls) did not end the "
                "episode; the cookbook's envs return terminated=True for it, otherwise the loop "
                "runs on to max_turns",
            )
        return not ended

    def _check_result_fields(self, where: str, result: StepResult) -> bool:
        """Record what is wrong with the flags, reward and metrics; whether the episode ended."""
        for flag in ("terminated", "truncated"):
            value = getattr(result, flag)
            if not isinstance(value, bool):
                self._error(
                    where, f"StepResult.{flag} is {value!r} ({type(value).__name__}), not a bool"
                )
        if result.terminated is True and result.truncated is True:
            self._error(
                where,
                "terminated and truncated are both True; an episode is either terminated by task "
                "logic or truncated for another reason",
            )
        problem = _number_problem(result.reward)
        if problem:
            self._error(where, f"reward {problem}")
        if not isinstance(result.metrics, dict):
            self._error(
                where, f"metrics is a {type(result.metrics).__name__}, not a dict[str, float]"
            )
            return bool(result.terminated or result.truncated)
        for key, value in result.metrics.items():
            if not isinstance(key, str):
                self._error(where, f"metrics key {key!r} is not a string")
            problem = _number_problem(value)
            if problem:
                self._error(where, f"metrics[{key!r}] {problem}")
        return bool(result.terminated or result.truncated)

    def _check_history(
        self,
        where: str,
        before: list[Message],
        message: Message,
        result: StepResult,
        history: list[Message],
        ended: bool,
    ) -> None:
        if result.messages != history:
            self._error(
                where,
                "result.messages differs from env.messages "
                f"({_difference(result.messages, history)}); "
                "both must be the whole conversation so far",
            )
        if history[: len(before)] != before:
            self._error(
                where,
                "step changed messages already in the history; only append, because the loop "
                "renders each message once and never re-renders earlier turns",
            )
            return
        appended = history[len(before) :]
        if not appended or appended[0] != message:
            self._error(
                where,
                "the first message step appends to the history must be the assistant message it "
                "was given, unchanged",
            )
        self._check_messages(where, "env.messages", appended, first=len(before))
        self._check_tool_answers(where, message, appended, ended)

    def _check_tool_answers(
        self, where: str, message: Message, appended: list[Message], ended: bool
    ) -> None:
        names_by_id = {
            call["id"]: call["function"]["name"] for call in message.get("tool_calls", [])
        }
        answers = [m for m in appended if isinstance(m, dict) and m.get("role") == "tool"]
        answer_counts = Counter(answer.get("tool_call_id") for answer in answers)
        for call_id, name in names_by_id.items():
            count = answer_counts[call_id]
            # An episode that ends on this step is never rendered again, so calls may go unanswered.
            if count == 0 and not ended:
                self._error(
                    where,
                    f"a call to {name!r} got no tool message carrying its tool_call_id; "
                    "every tool call needs exactly one",
                )
            elif count > 1:
                self._error(where, f"a call to {name!r} got {count} tool messages, not one")
        for answer in answers:
            self._check_tool_answer(where, answer, names_by_id)

    def _check_tool_answer(self, where: str, answer: Message, names_by_id: dict[str, str]) -> None:
        call_id = answer.get("tool_call_id")
        if call_id is None:
            text = "a tool message has no tool_call_id; set it to the id of the call it answers"
            self._error(where, text)
        elif call_id not in names_by_id:
            text = (
                "a tool message's tool_call_id matches no call; copy the id of the call it answers"
            )
            self._error(where, text)
        elif "name" not in answer:
            name = names_by_id[call_id]
            self._warn(
                where,
                f"the tool message answering a call to {name!r} has no name; set name={name!r} "
                "(chat templates that show tool names read it)",
            )
        elif answer["name"] != names_by_id[call_id]:
            self._error(
                where,
                f"the tool message answering a call to {names_by_id[call_id]!r} "
                f"has name={answer['name']!r}",
            )

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


# --- Small checks -----------------------------------------------------------------------------


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"is a {type(message).__name__}, not a message dict"
    role = message.get("role")
    if role not in VALID_ROLES:
        return f"has role {role!r}; roles are {', '.join(VALID_ROLES)}"
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return f"has content of type {type(content).__name__}, not a string"
    return None


def _number_problem(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"is {value!r} ({type(value).__name__}); it must be a float (an int will do)"
    if not math.isfinite(value):
        return f"is {value!r}; it must be finite (one NaN or inf poisons the whole batch)"
    return None


def _tool_spec_problems(spec: Any) -> list[str]:
    shape = '{"type": "function", "function": {"name", "description", "parameters"}}'
    if not isinstance(spec, dict) or spec.get("type") != "function":
        return [f"is not {shape}"]
    function = spec.get("function")
    if not isinstance(function, dict):
        return [f"has no function dict; the shape is {shape}"]
    problems = []
    if not isinstance(function.get("name"), str) or not function["name"]:
        problems.append("has no function.name (a non-empty string)")
    if not isinstance(function.get("description"), str):
        problems.append("has no function.description (a string)")
    parameters = function.get("parameters")
    if not isinstance(parameters, dict):
        problems.append("has no function.parameters (a JSON Schema dict)")
    else:
        problems += _schema_problems(parameters)
    return problems


def _schema_problems(schema: dict[str, Any]) -> list[str]:
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        at = "/".join(map(str, exc.absolute_path)) or "the top level"
        return [f"has function.parameters that is not a valid JSON Schema: {exc.message} (at {at})"]
    if schema.get("type") != "object":
        got = schema.get("type")
        return [
            f"has function.parameters of type {got!r}; "
            'it must be "type": "object" (the arguments are a JSON object)'
        ]
    return []


def _difference(messages: Any, history: list[Message]) -> str:
    """How ``messages`` differs from ``history``, in words that do not depend on the turn."""
    if not isinstance(messages, list):
        return f"it is a {type(messages).__name__}, not a list"
    missing = len(history) - len(messages)
    if missing:
        return f"{_plural(abs(missing), 'message')} {'short' if missing > 0 else 'too many'}"
    return "same length, different messages"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
