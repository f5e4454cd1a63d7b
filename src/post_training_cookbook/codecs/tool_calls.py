"""Tool calls as text: ids, canonical JSON arguments, and finding calls in sampled text.

Arguments are canonical when they read ``json.dumps(obj, ensure_ascii=False)``: exactly
what Hugging Face chat templates print for a dict through their ``tojson`` filter. Our
``Message`` carries arguments as a JSON string (OpenAI style) while most templates
(Qwen2.5's among them) ``tojson`` them, which would double-encode a string; so call
``to_template_messages`` before handing our messages to ``apply_chat_template``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from post_training_cookbook.types import FunctionCall, Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TAGGED_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_EMPTY_FENCE = re.compile(r"```[A-Za-z]*\s*```")


class ParseError(ValueError):
    """Sampled text that does not follow the chat format (e.g. a malformed tool call)."""


def new_tool_call_id() -> str:
    """A fresh, unique tool-call id in the OpenAI style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def dump_json(value: Any) -> str:
    """``value`` as JSON the way chat templates' ``tojson`` prints it."""
    return json.dumps(value, ensure_ascii=False)


def arguments_object(arguments: str | Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a call as a dict; raise ``ValueError`` unless they are a JSON object."""
    value = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    if not isinstance(value, dict):
        raise ValueError(f"tool-call arguments must be a JSON object, got {type(value).__name__}")
    return value


def canonical_arguments(arguments: str | Mapping[str, Any]) -> str:
    """The arguments re-encoded canonically (see the module docstring)."""
    return dump_json(arguments_object(arguments))


def make_tool_call(name: str, arguments: Mapping[str, Any]) -> ToolCall:
    """A ``ToolCall`` with a fresh id and canonical JSON-string arguments."""
    function = FunctionCall(name=name, arguments=dump_json(dict(arguments)))
    return ToolCall(id=new_tool_call_id(), type="function", function=function)


def to_template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose tool-call arguments are dicts, for ``apply_chat_template``."""
    converted: list[dict[str, Any]] = []
    for message in messages:
        copy: dict[str, Any] = dict(message)
        if message.get("tool_calls"):
            copy["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
        converted.append(copy)
    return converted


def _template_call(call: ToolCall) -> dict[str, Any]:
    arguments = arguments_object(call["function"]["arguments"])
    return {**call, "function": {**call["function"], "arguments": arguments}}


def call_from_object(value: Any, where: str) -> ToolCall:
    """The ``ToolCall`` in a decoded ``{"name": ..., "arguments": {...}}`` object."""
    if not isinstance(value, dict):
        raise ParseError(f"{where}: expected a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ParseError(f'{where}: missing a non-empty string "name"')
    if "arguments" not in value:
        raise ParseError(f'{where}: missing "arguments"')
    arguments = value["arguments"]
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        raise ParseError(f'{where}: "arguments" must be a JSON object, got {kind}')
    return make_tool_call(name, arguments)


def split_tagged_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside ``<tool_call>`` blocks (stripped) and the calls inside them, in order."""
    calls: list[ToolCall] = []
    for number, match in enumerate(_TAGGED_CALL.finditer(text), start=1):
        where = f"tool call {number}"
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError as error:
            raise ParseError(f"{where}: invalid JSON ({error})") from None
        calls.append(call_from_object(value, where))
    rest = _TAGGED_CALL.sub("", text)
    if TOOL_CALL_OPEN in rest:
        raise ParseError(f"unterminated {TOOL_CALL_OPEN} tag")
    if TOOL_CALL_CLOSE in rest:
        raise ParseError(f"{TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}")
    return rest.strip(), calls


def split_bare_json_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Like ``split_tagged_calls`` for untagged calls: bare or fenced JSON objects.

    A JSON object counts as a call when it has both ``"name"`` and ``"arguments"``; other
    JSON in the text stays content. A fence left empty by removing its call is dropped.
    """
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pieces: list[str] = []
    position = 0
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict) and "name" in value and "arguments" in value:
            calls.append(call_from_object(value, f"tool call {len(calls) + 1}"))
            pieces.append(text[position:start])
            position = end
        start = text.find("{", end)
    pieces.append(text[position:])
    content = "".join(pieces)
    if calls:
        content = _EMPTY_FENCE.sub("", content)
    return content.strip(), calls
