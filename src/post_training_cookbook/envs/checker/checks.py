"""The contract checks: what is wrong with an env's messages, tool specs, results and history."""

from __future__ import annotations

import math
import numbers
from collections import Counter
from typing import Any

from post_training_cookbook.envs.base import Env, StepResult
from post_training_cookbook.envs.checker.report import _plural, _Recorder
from post_training_cookbook.types import Message

VALID_ROLES = ("system", "user", "assistant", "tool")


# --- Checks of one episode, recorded where they are seen ---------------------------------------


def _check_messages(
    record: _Recorder, where: str, source: str, messages: list[Any], first: int = 0
) -> None:
    for index, message in enumerate(messages, first):
        problem = _message_problem(message)
        if problem:
            record.error(where, f"message {index} of {source} {problem}")


def _check_returns_copy(
    record: _Recorder, env: Env, history: list[Message], opening: list[Message]
) -> None:
    opening.append(Message(role="user", content="check_env probe"))
    try:
        aliased = env.messages != history
    finally:
        opening.pop()  # restore the env's history if it was aliased
    if aliased:
        record.error(
            "reset",
            "reset returned the env's own history list: appending to the returned list "
            "changed env.messages; return a copy (list(self._messages))",
        )


def _check_tool_specs(record: _Recorder, env: Env) -> list[tuple[str, Any]]:
    """Record what is wrong with ``env.tool_specs``; the usable (name, schema) pairs."""
    try:
        specs = env.tool_specs
    except Exception as exc:
        record.error("tool_specs", f"env.tool_specs raised {exc!r}")
        return []
    if not isinstance(specs, list):
        record.error("tool_specs", f"env.tool_specs is a {type(specs).__name__}, not a list")
        return []
    tools = []
    for index, spec in enumerate(specs):
        for problem in _tool_spec_problems(spec):
            record.error("tool_specs", f"tool_specs[{index}] {problem}")
        function = spec.get("function") if isinstance(spec, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            tools.append((function["name"], function.get("parameters")))
    repeated = sorted(name for name, count in Counter(n for n, _ in tools).items() if count > 1)
    if repeated:
        record.error("tool_specs", f"tool names must be unique; repeated: {', '.join(repeated)}")
    return tools


def _check_result_fields(record: _Recorder, where: str, result: StepResult) -> bool:
    """Record what is wrong with the flags, reward and metrics; whether the episode ended."""
    for flag in ("terminated", "truncated"):
        value = getattr(result, flag)
        if not isinstance(value, bool):
            record.error(
                where, f"StepResult.{flag} is {value!r} ({type(value).__name__}), not a bool"
            )
    if result.terminated is True and result.truncated is True:
        record.error(
            where,
            "terminated and truncated are both True; an episode is either terminated by task "
            "logic or truncated for another reason",
        )
    problem = _number_problem(result.reward)
    if problem:
        record.error(where, f"reward {problem}")
    if not isinstance(result.metrics, dict):
        record.error(where, f"metrics is a {type(result.metrics).__name__}, not a dict[str, float]")
        return bool(result.terminated or result.truncated)
    for key, value in result.metrics.items():
        if not isinstance(key, str):
            record.error(where, f"metrics key {key!r} is not a string")
        problem = _number_problem(value)
        if problem:
            record.error(where, f"metrics[{key!r}] {problem}")
    return bool(result.terminated or result.truncated)


def _check_history(
    record: _Recorder,
    where: str,
    before: list[Message],
    message: Message,
    result: StepResult,
    history: list[Message],
    ended: bool,
) -> None:
    if result.messages != history:
        record.error(
            where,
            "result.messages differs from env.messages "
            f"({_difference(result.messages, history)}); "
            "both must be the whole conversation so far",
        )
    if history[: len(before)] != before:
        record.error(
            where,
            "step changed messages already in the history; only append, because the loop "
            "renders each message once and never re-renders earlier turns",
        )
        return
    appended = history[len(before) :]
    if not appended or appended[0] != message:
        record.error(
            where,
            "the first message step appends to the history must be the assistant message it "
            "was given, unchanged",
        )
    _check_messages(record, where, "env.messages", appended, first=len(before))
    _check_tool_answers(record, where, message, appended, ended)


def _check_tool_answers(
    record: _Recorder, where: str, message: Message, appended: list[Message], ended: bool
) -> None:
    names_by_id = {call["id"]: call["function"]["name"] for call in message.get("tool_calls", [])}
    answers = [m for m in appended if isinstance(m, dict) and m.get("role") == "tool"]
    answer_counts = Counter(answer.get("tool_call_id") for answer in answers)
    for call_id, name in names_by_id.items():
        count = answer_counts[call_id]
        # An episode that ends on this step is never rendered again, so calls may go unanswered.
        if count == 0 and not ended:
            record.error(
                where,
                f"a call to {name!r} got no tool message carrying its tool_call_id; "
                "every tool call needs exactly one",
            )
        elif count > 1:
            record.error(where, f"a call to {name!r} got {count} tool messages, not one")
    for answer in answers:
        _check_tool_answer(record, where, answer, names_by_id)


def _check_tool_answer(
    record: _Recorder, where: str, answer: Message, names_by_id: dict[str, str]
) -> None:
    call_id = answer.get("tool_call_id")
    if call_id is None:
        text = "a tool message has no tool_call_id; set it to the id of the call it answers"
        record.error(where, text)
    elif call_id not in names_by_id:
        text = "a tool message's tool_call_id matches no call; copy the id of the call it answers"
        record.error(where, text)
    elif "name" not in answer:
        name = names_by_id[call_id]
        record.warn(
            where,
            f"the tool message answering a call to {name!r} has no name; set name={name!r} "
            "(chat templates that show tool names read it)",
        )
    elif answer["name"] != names_by_id[call_id]:
        record.error(
            where,
            f"the tool message answering a call to {names_by_id[call_id]!r} "
            f"has name={answer['name']!r}",
        )


# --- Small checks: what is wrong with one value, in words ----------------------------------------


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
    # imported here: the envs package stays importable where only training runs (a GPU image)
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

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
