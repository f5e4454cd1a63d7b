"""SFT conversations in the OpenAI message format, read from JSONL and checked.

A file holds one conversation a line (JSONL)::

    {"messages": [{"role": "system", ...}, {"role": "user", ...},
                  {"role": "assistant", "tool_calls": [{"id": "call_0", ...}]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "..."},
                  {"role": "assistant", "content": "42"}],
     "tools": [{"type": "function", "function": {...}}]}

Bad data raises ``SFTDataError`` naming the file and line: not JSON, an unknown role, a tool
call without an id, a tool result that answers no call.

Rules the data is held to (``SFTDataError`` at the first line that breaks one): every tool
call gets its tool result before the next other message (a conversation may end on calls);
``tools`` is a list of ``{"type": "function", "function": {"name", "description"?,
"parameters"?}}`` with distinct names (a codec pastes it into the prompt as it is);
``tool_calls`` is a list, ``tool_call_id``, ``name`` and ``reasoning_content`` are strings;
``weight`` (OpenAI's fine-tuning key) is refused, since ignoring its 0 would train on the
message. Other message keys no codec renders (``refusal``, ``annotations`` ...) are dropped
and counted (``RenderedData.ignored_keys``; ``train_sft`` notes them and writes them to
data.json), not refused: exported chats carry them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from post_training_cookbook.types import Message, ToolSpec

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = frozenset(
    {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}
)
"""The message keys a codec renders; others are dropped (and counted), ``weight`` refused."""


class SFTDataError(ValueError):
    """A conversation that cannot be trained on; the message starts with ``file:line``."""


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    tools: list[ToolSpec] | None = None
    source: str = "<conversation>"
    """Where it came from (``file:line``), for errors and skip reports."""
    ignored_keys: Mapping[str, int] = field(default_factory=dict)
    """Message keys no codec renders, dropped: how many messages held each."""

    def to_json(self) -> str:
        """One JSONL line: ``{"messages": ..., "tools": ...}``."""
        record: dict[str, Any] = {"messages": self.messages}
        if self.tools:
            record["tools"] = self.tools
        return json.dumps(record, ensure_ascii=False)


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file, checked; ``SFTDataError`` names the bad line."""
    source = Path(path)
    if source.is_dir():
        raise SFTDataError(f"{source}: is a folder, not a JSONL file")
    if not source.exists():
        raise SFTDataError(f"{source}: no such file")
    conversations = []
    with source.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            conversations.append(conversation_of_line(raw, f"{source}:{number}"))
    if not conversations:
        raise SFTDataError(f"{source}: holds no conversation")
    return conversations


def conversation_of_line(raw: bytes, where: str) -> Conversation:
    """One JSONL line's conversation, checked."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SFTDataError(f"{where}: not UTF-8 (byte {exc.start} of the line)") from None
    except json.JSONDecodeError as exc:
        raise SFTDataError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise SFTDataError(f"{where}: nested too deeply to be a conversation") from None
    return conversation_of(record, where)


def conversation_of(record: object, where: str) -> Conversation:
    """A checked ``Conversation`` from a ``{"messages", "tools"}`` mapping (or a ready one).
    Message keys no codec renders are dropped and counted in ``ignored_keys``."""
    if isinstance(record, Conversation):
        check_messages(record.messages, record.source)
        check_tools(record.tools, record.source)
        return record
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list):
        raise SFTDataError(f'{where}: a conversation is an object with a "messages" list')
    unknown = sorted(set(record) - {"messages", "tools"})
    if unknown:
        raise SFTDataError(f'{where}: unknown key(s) {unknown}; expected "messages", "tools"')
    tools = record.get("tools")
    check_tools(tools, where)
    messages: list[Message] = record["messages"]
    check_messages(messages, where)
    ignored: Counter[str] = Counter()
    kept = []
    for message in messages:
        extra = set(message) - MESSAGE_KEYS
        ignored.update(extra)
        kept.append(Message(**{k: v for k, v in message.items() if k not in extra}))  # type: ignore[typeddict-item]
    return Conversation(kept, tools or None, where, dict(ignored))


def check_tools(tools: object, where: str) -> None:
    """``tools`` is None or a list of OpenAI function tools with distinct names, each
    ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``: a codec
    pastes them into the prompt as they are."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise SFTDataError(f'{where}: "tools" must be a list of OpenAI tool objects')
    names: set[str] = set()
    for index, tool in enumerate(tools):
        at = f"{where}: tools[{index}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise SFTDataError(f'{at}: a tool is {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise SFTDataError(f"{at}: the function has no name")
        if name in names:
            raise SFTDataError(f"{at}: two tools are named {name!r}")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise SFTDataError(f"{at}: description must be a string")
        if not isinstance(function.get("parameters", {}), Mapping):
            raise SFTDataError(f"{at}: parameters must be a JSON schema object")


def check_messages(messages: Sequence[object], where: str) -> None:
    """The message-format rules the codecs rely on; ``SFTDataError`` at the first broken one.
    Every tool call is answered by a tool result before the next other message (a
    conversation may end on calls: the model learns to make them)."""
    open_calls: dict[str, int] = {}
    """Calls not answered yet: their id, and the message that made them."""
    has_assistant = False
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, Mapping):
            raise SFTDataError(f"{at}: a message is an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise SFTDataError(f"{at}: unknown role {role!r} (expected one of {ROLES})")
        _check_fields(message, at)
        if role != "tool" and open_calls:
            raise SFTDataError(
                f"{at}: tool call(s) {sorted(open_calls)} of message "
                f"{min(open_calls.values())} got no tool result before it"
            )
        if role == "assistant":
            has_assistant = True
            for call in message.get("tool_calls") or []:
                open_calls[_checked_call(call, at)] = index
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not call_id or call_id not in open_calls:
                raise SFTDataError(
                    f"{at}: tool result for no call (tool_call_id {call_id!r} answers no "
                    "earlier assistant tool call)"
                )
            del open_calls[call_id]
        elif message.get("tool_calls"):
            raise SFTDataError(f"{at}: only assistant messages carry tool_calls")
    if not has_assistant:
        raise SFTDataError(f"{where}: no assistant message to train on")


def _check_fields(message: Mapping[str, Any], at: str) -> None:
    """The types of the fields a codec renders; ``weight`` refused, not ignored."""
    if "weight" in message:
        raise SFTDataError(
            f'{at}: "weight" is not supported (in OpenAI\'s fine-tuning format 0 means "do '
            'not train on this message"; ignoring it would train on it): choose the trained '
            "turns with train_on, or leave the message out"
        )
    content = message.get("content", "")
    if content is not None and not isinstance(content, str):
        raise SFTDataError(f"{at}: content must be a string")
    for name in ("tool_call_id", "name", "reasoning_content"):
        if message.get(name) is not None and not isinstance(message[name], str):
            raise SFTDataError(f"{at}: {name} must be a string")
    if not isinstance(message.get("tool_calls") or [], list):
        raise SFTDataError(f"{at}: tool_calls must be a list")


def _checked_call(call: object, at: str) -> str:
    if not isinstance(call, Mapping):
        raise SFTDataError(f"{at}: a tool call is an object")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise SFTDataError(f"{at}: tool call without id")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise SFTDataError(f"{at}: tool call {call_id!r} has no function name")
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (json.JSONDecodeError, RecursionError):
        parsed = None
    if not isinstance(parsed, Mapping):
        raise SFTDataError(f"{at}: tool call {call_id!r}: arguments must be a JSON object")
    return call_id


def load_conversations(
    conversations: str | Path | Iterable[Conversation | Mapping[str, Any]],
) -> list[Conversation]:
    """A JSONL path, or conversations as ``Conversation``s or ``{"messages", "tools"}``."""
    if isinstance(conversations, str | Path):
        return read_conversations(conversations)
    checked = [
        conversation_of(record, f"conversations[{index}]")
        for index, record in enumerate(conversations)
    ]
    if not checked:
        raise SFTDataError("no conversations given")
    return checked
