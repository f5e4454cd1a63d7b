"""The assistant messages each scripted episode sends, and tool arguments made from JSON schemas."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from post_training_cookbook.envs.base import Task
from post_training_cookbook.types import Message, ToolCall

UNKNOWN_TOOL_NAME = "check_env_no_such_tool"
MALFORMED_ARGUMENTS = '{"arguments": not json'
WRONG_ANSWER = "check_env: a deliberately wrong answer"


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
