"""Chat records shared by every layer, in the OpenAI chat format.

``Message`` is a ``TypedDict`` so that environments build it with
``Message(role=..., content=...)`` and read optional fields with ``.get``.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, Required, TypedDict


class FunctionCall(TypedDict):
    name: str
    arguments: str
    """The call's arguments as a JSON object encoded in a string."""


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(TypedDict, total=False):
    role: Required[str]
    """``system``, ``user``, ``assistant`` or ``tool``."""
    content: str
    tool_calls: list[ToolCall]
    tool_call_id: str
    """On a ``tool`` message: the ``id`` of the call it answers."""
    name: str
    """On a ``tool`` message: the name of the tool that produced it."""
    reasoning_content: str
    """On an ``assistant`` message of a thinking model: the text inside ``<think>``."""


class FunctionSpec(TypedDict):
    name: str
    description: str
    parameters: dict[str, Any]
    strict: NotRequired[bool]


class ToolSpec(TypedDict):
    """An OpenAI function-tool schema, the form chat templates render into the prompt."""

    type: Literal["function"]
    function: FunctionSpec


def content_text(content: Any) -> str | None:
    """A message's ``content`` as the text a codec renders: a string as it is, ``None`` as
    ``None``, the OpenAI content-parts form (``[{"type": "text", "text": ...}]``) joined;
    ``None`` for anything else, which no codec can render (``content_problem`` says why)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and content_problem(content) is None:
        return "".join(part["text"] for part in content)
    return None


def content_problem(content: Any) -> str | None:
    """Why ``content`` is no message content, or None when a codec can render it."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"content of type {type(content).__name__}: content must be a string"
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            return f"content part {index} is {kind!r}: only text parts can be rendered"
        if not isinstance(part.get("text"), str):
            return f"content part {index} has no string 'text'"
    return None
