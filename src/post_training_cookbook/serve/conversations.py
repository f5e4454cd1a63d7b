"""Token-in-token-out across HTTP calls: a request that continues a conversation the server
served is extended, not re-rendered.

A chat client sends the whole history every call. Rendering it afresh would re-tokenize the
model's earlier turns from their text, and text does not always tokenize back to the tokens
that were sampled; the training samples (and the KV the model saw) would then differ from
what was sampled. So every served turn is remembered by its conversation: the tools, the
request's messages and the assistant message returned. A request whose messages, up to their
last assistant message, are exactly such a conversation gets the tokens of that turn (prompt +
sampled, as sampled) plus ``codec.render_extension`` of the messages after it, exactly as
``rollout/play.py`` extends an episode.

Anything else renders afresh with ``codec.render_prompt``: a conversation's first call, or a
history the client changed (trimmed, summarised, reordered, an assistant message edited or
written by someone else). For the external-agent adapter such a fresh render after the first
call is a *break*: the episode's next training segment starts there (``agents/``).

Messages compare as the codec would render them: content (``None`` as empty), tool calls
(id, name, and arguments as a JSON object, so re-serialised arguments still match), tool-call
ids and names, reasoning; fields the API adds (``refusal``, ``annotations``...) are not read.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from post_training_cookbook.codecs.tool_calls import arguments_object
from post_training_cookbook.types import Message, ToolSpec

if TYPE_CHECKING:
    from post_training_cookbook.codecs import Codec


@dataclass(frozen=True)
class ServedTurn:
    """What one served completion left behind for a conversation to continue from."""

    tokens: list[int]
    """The prompt and the sampled tokens, as sampled."""
    sampled: list[int]
    number: int = -1
    """Its place in an episode's turns (``agents/``); -1 outside an episode."""


@dataclass(frozen=True)
class PromptPlan:
    tokens: list[int]
    parent: ServedTurn | None
    """The served turn the prompt extends; ``None``: rendered afresh."""


class ConversationStore:
    """The served turns a later request may extend, least recently used dropped first once
    there are more than ``max_turns`` or they hold more than ``max_tokens`` tokens (about
    8 bytes each)."""

    def __init__(self, max_turns: int = 4096, max_tokens: int = 8_000_000) -> None:
        self._turns: OrderedDict[str, ServedTurn] = OrderedDict()
        self._max_turns = max_turns
        self._max_tokens = max_tokens
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._turns)

    def plan(self, codec: Codec, messages: list[Message], tools: list[ToolSpec]) -> PromptPlan:
        """The prompt tokens for ``messages``: extended from a served turn when they continue
        one, else rendered afresh."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        key = conversation_key(tools, messages[: last + 1])
        parent = self._turns.get(key) if last >= 0 else None
        if parent is None:
            return PromptPlan(codec.render_prompt(messages, tools or None), None)
        self._turns.move_to_end(key)
        added = messages[last + 1 :]
        extension = codec.render_extension(added, sampled_tokens=parent.sampled)
        return PromptPlan(parent.tokens + extension, parent)

    def remember(
        self,
        tools: list[ToolSpec],
        messages: list[Message],
        reply: Message,
        turn: ServedTurn,
    ) -> None:
        """Keep ``turn`` for the conversation ``messages`` + ``reply``."""
        key = conversation_key(tools, [*messages, reply])
        if key in self._turns:
            self._tokens -= len(self._turns.pop(key).tokens)
        self._turns[key] = turn
        self._tokens += len(turn.tokens)
        while len(self._turns) > 1 and (
            len(self._turns) > self._max_turns or self._tokens > self._max_tokens
        ):
            _, dropped = self._turns.popitem(last=False)
            self._tokens -= len(dropped.tokens)


def conversation_key(tools: list[ToolSpec], messages: list[Message]) -> str:
    """A digest of what the codec would render of ``tools`` and ``messages``."""
    canonical = {"tools": tools, "messages": [_rendered_fields(m) for m in messages]}
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _rendered_fields(message: Message) -> dict[str, Any]:
    fields: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if calls:
        fields["tool_calls"] = [
            [call["id"], call["function"]["name"], arguments_object(call["function"]["arguments"])]
            for call in calls
        ]
    for name in ("tool_call_id", "name", "reasoning_content"):
        if message.get(name):
            fields[name] = message[name]
    return fields
