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
