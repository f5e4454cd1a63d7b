"""SFT data: conversations in the OpenAI message format, checked, rendered, batched.

A file holds one conversation a line (JSONL)::

    {"messages": [{"role": "system", ...}, {"role": "user", ...},
                  {"role": "assistant", "tool_calls": [{"id": "call_0", ...}]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "..."},
                  {"role": "assistant", "content": "42"}],
     "tools": [{"type": "function", "function": {...}}]}

Bad data raises ``SFTDataError`` naming the file and line: not JSON, an unknown role, a tool
call without an id, a tool result that answers no call. The model's codec renders each
conversation with the env's tools and marks the tokens the model would have sampled (each
assistant turn's body and its stop token); those are the trained tokens (``train_on="all"``),
or only the last assistant turn's (``"last"``). A conversation longer than
``max_model_length`` is skipped and counted, never cut.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from post_training_cookbook.codecs import Codec
from post_training_cookbook.trainer.types import TrainingSample
from post_training_cookbook.types import Message, ToolSpec

ROLES = ("system", "user", "assistant", "tool")


class SFTDataError(ValueError):
    """A conversation that cannot be trained on; the message starts with ``file:line``."""


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    tools: list[ToolSpec] | None = None
    source: str = "<conversation>"
    """Where it came from (``file:line``), for errors and skip reports."""

    def to_json(self) -> str:
        """One JSONL line: ``{"messages": ..., "tools": ...}``."""
        record: dict[str, Any] = {"messages": self.messages}
        if self.tools:
            record["tools"] = self.tools
        return json.dumps(record, ensure_ascii=False)


@dataclass(frozen=True)
class SFTExample:
    tokens: list[int]
    mask: list[int]
    """1 on the trained tokens, 0 on context."""
    source: str = "<conversation>"

    def training_sample(self) -> TrainingSample:
        zeros = [0.0] * len(self.tokens)
        return TrainingSample(self.tokens, [float(m) for m in self.mask], zeros, list(zeros))


@dataclass
class RenderedData:
    examples: list[SFTExample]
    skipped_too_long: list[str] = field(default_factory=list)
    """Sources of the conversations longer than ``max_model_length``."""
    skipped_untrained: list[str] = field(default_factory=list)
    """Sources of the conversations with no trained token (no assistant turn to learn)."""


# ---------------------------------------------------------------- reading and checking


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file, checked; ``SFTDataError`` names the bad line."""
    source = Path(path)
    conversations = []
    with source.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{source}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SFTDataError(f"{where}: not JSON ({exc.msg})") from None
            conversations.append(conversation_of(record, where))
    if not conversations:
        raise SFTDataError(f"{source}: holds no conversation")
    return conversations


def conversation_of(record: object, where: str) -> Conversation:
    """A checked ``Conversation`` from a ``{"messages", "tools"}`` mapping (or a ready one)."""
    if isinstance(record, Conversation):
        check_messages(record.messages, record.source)
        return record
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list):
        raise SFTDataError(f'{where}: a conversation is an object with a "messages" list')
    unknown = sorted(set(record) - {"messages", "tools"})
    if unknown:
        raise SFTDataError(f'{where}: unknown key(s) {unknown}; expected "messages", "tools"')
    tools = record.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(tool, Mapping) for tool in tools)
    ):
        raise SFTDataError(f'{where}: "tools" must be a list of OpenAI tool objects')
    messages: list[Message] = record["messages"]
    check_messages(messages, where)
    return Conversation(messages, tools or None, where)


def check_messages(messages: Sequence[object], where: str) -> None:
    """The message-format rules the codecs rely on; ``SFTDataError`` at the first broken one."""
    open_calls: set[str] = set()
    has_assistant = False
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, Mapping):
            raise SFTDataError(f"{at}: a message is an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise SFTDataError(f"{at}: unknown role {role!r} (expected one of {ROLES})")
        content = message.get("content", "")
        if content is not None and not isinstance(content, str):
            raise SFTDataError(f"{at}: content must be a string")
        if role == "assistant":
            has_assistant = True
            for call in message.get("tool_calls") or []:
                open_calls.add(_checked_call(call, at))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not call_id or call_id not in open_calls:
                raise SFTDataError(
                    f"{at}: tool result for no call (tool_call_id {call_id!r} answers no "
                    "earlier assistant tool call)"
                )
            open_calls.discard(call_id)
        elif message.get("tool_calls"):
            raise SFTDataError(f"{at}: only assistant messages carry tool_calls")
    if not has_assistant:
        raise SFTDataError(f"{where}: no assistant message to train on")


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
    except json.JSONDecodeError:
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


# ---------------------------------------------------------------- rendering


def render_examples(
    codec: Codec, conversations: Sequence[Conversation], train_on: str, max_model_length: int
) -> RenderedData:
    """Each conversation's tokens and trained-token mask, skipping (and counting) those
    longer than ``max_model_length`` and those with nothing to train on."""
    data = RenderedData(examples=[])
    for conversation in conversations:
        tokens, mask = codec.render_conversation(conversation.messages, conversation.tools)
        if len(tokens) > max_model_length:
            data.skipped_too_long.append(conversation.source)
            continue
        if train_on == "last":
            mask = _last_turn_only(codec, conversation, tokens, mask)
        if not any(mask[1:]):
            data.skipped_untrained.append(conversation.source)
            continue
        mask = [0, *mask[1:]]  # position 0 has no context to be predicted from
        data.examples.append(SFTExample(tokens, mask, conversation.source))
    return data


def _last_turn_only(
    codec: Codec, conversation: Conversation, tokens: list[int], mask: list[int]
) -> list[int]:
    """``mask`` without the assistant turns before the last one. The conversation up to
    that turn renders as a prefix of the whole (token-in-token-out), so the turns it holds
    are the ones to drop."""
    messages = conversation.messages
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    if last == 0:
        return mask
    prefix, _ = codec.render_conversation(messages[:last], conversation.tools)
    if tokens[: len(prefix)] != prefix:
        raise SFTDataError(
            f"{conversation.source}: the codec renders the conversation before its last "
            "assistant turn differently from the whole one's start, so train_on='last' "
            "cannot tell the turns apart; use train_on='all'"
        )
    return [0] * len(prefix) + mask[len(prefix) :]


# ---------------------------------------------------------------- batches


def plan_batches(
    lengths: Sequence[int], batch_tokens: int, num_epochs: int, num_steps: int | None, seed: int
) -> list[list[int]]:
    """Every optimizer step's example indices, fixed by the data and ``seed`` alone (so a
    resumed run takes up exactly where it stopped). Each epoch is a fresh shuffle, cut into
    batches whose rendered lengths sum to at most ``batch_tokens``. With ``num_steps`` the
    plan is cut there, or epochs are added until it is reached."""
    plan: list[list[int]] = []
    epoch = 0
    while (num_steps is None and epoch < num_epochs) or (
        num_steps is not None and len(plan) < num_steps
    ):
        order = list(range(len(lengths)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        batch: list[int] = []
        used = 0
        for index in order:
            if batch and used + lengths[index] > batch_tokens:
                plan.append(batch)
                batch, used = [], 0
            batch.append(index)
            used += lengths[index]
        plan.append(batch)
        epoch += 1
    return plan[:num_steps] if num_steps is not None else plan
