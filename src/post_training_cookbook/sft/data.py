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
``max_model_length`` is skipped and counted, never cut; one whose text alone holds more
characters than ``max_model_length`` tokens could spell (the tokenizer's longest vocabulary
entry a token) is skipped before it is tokenized, so a 100 MB conversation costs a count of
its characters, not a tokenization.

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

import hashlib
import json
import random
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from post_training_cookbook.codecs import Codec
from post_training_cookbook.trainer.types import TrainingSample
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


@dataclass(frozen=True)
class SFTExample:
    tokens: list[int]
    mask: list[int]
    """1 on the trained tokens, 0 on context."""
    source: str = "<conversation>"
    prompt: str = ""
    """Its tools and system message (``prompt_key``): conversations with the same one
    render the same prefix."""

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
    ignored_keys: Counter[str] = field(default_factory=Counter)
    """Message keys no codec renders, dropped when read: how many messages held each."""


# ---------------------------------------------------------------- reading and checking


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


# ---------------------------------------------------------------- rendering


def render_examples(
    codec: Codec, conversations: Sequence[Conversation], train_on: str, max_model_length: int
) -> RenderedData:
    """Each conversation's tokens and trained-token mask, skipping (and counting) those
    longer than ``max_model_length`` and those with nothing to train on."""
    data = RenderedData(examples=[])
    most_chars = max_model_length * chars_per_token_bound(codec.tokenizer)
    for conversation in conversations:
        data.ignored_keys.update(conversation.ignored_keys)
        if text_chars(conversation, past=most_chars) > most_chars:  # too long for sure
            data.skipped_too_long.append(conversation.source)
            continue
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
        data.examples.append(
            SFTExample(tokens, mask, conversation.source, prompt_key(conversation))
        )
    return data


def chars_per_token_bound(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` decodes to, or more: its longest
    vocabulary entry (a byte-level entry spells each byte as one character, and a byte is
    at most one character of text). Computed once a tokenizer."""
    bound = _CHARS_PER_TOKEN.get(tokenizer)
    if bound is None:
        bound = max(1, max(map(len, tokenizer.get_vocab()), default=1))
        _CHARS_PER_TOKEN[tokenizer] = bound
    return bound


_CHARS_PER_TOKEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def text_chars(conversation: Conversation, past: int) -> int:
    """At most the characters of the text every codec renders for ``conversation``: the
    messages' contents and reasoning (stripped, as some templates strip them), the tool
    calls' names and their arguments' keys and values, the tools' names and descriptions.
    Counting stops once it passes ``past``."""
    total = 0
    for message in conversation.messages:
        for text in (message.get("content"), message.get("reasoning_content")):
            total += len(text.strip()) if isinstance(text, str) else 0
        for call in message.get("tool_calls") or []:
            function = call["function"]
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                arguments = json.loads(arguments)  # checked: a JSON object
            total += len(function["name"]) + _strings_chars(arguments, past - total)
        if total > past:
            return total
    for tool in conversation.tools or []:
        spec = tool["function"]
        total += len(spec["name"]) + len(spec.get("description") or "")
    return total


def _strings_chars(value: Any, past: int) -> int:
    """The characters of the strings in ``value`` (keys too), counted until past ``past``."""
    total = 0
    pending = [value]
    while pending and total <= past:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            pending += item
    return total


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


def prompt_key(conversation: Conversation) -> str:
    """A digest of what a conversation's rendered prefix depends on before its first user
    turn (a digest: tool docs run to tens of kilobytes, once per conversation)."""
    messages = conversation.messages
    system = messages[0].get("content") if messages and messages[0]["role"] == "system" else None
    text = json.dumps([conversation.tools, system], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def plan_batches(
    lengths: Sequence[int],
    batch_tokens: int,
    num_epochs: int,
    num_steps: int | None,
    seed: int,
    prompts: Sequence[str] | None = None,
) -> list[list[int]]:
    """Every optimizer step's example indices, fixed by the data and ``seed`` alone (so a
    resumed run takes up exactly where it stopped). Each epoch is a fresh shuffle, cut into
    batches whose rendered lengths sum to at most ``batch_tokens``. With ``prompts`` (each
    example's ``prompt_key``) an epoch takes the prompts in the order their first example
    comes in the shuffle, and a batch never holds two. With ``num_steps`` the plan is cut
    there, or epochs are added until it is reached."""
    plan: list[list[int]] = []
    epoch = 0
    while (num_steps is None and epoch < num_epochs) or (
        num_steps is not None and len(plan) < num_steps
    ):
        order = list(range(len(lengths)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        if prompts is not None:
            first = {
                prompt: rank for rank, prompt in enumerate(dict.fromkeys(prompts[i] for i in order))
            }
            order.sort(key=lambda i: first[prompts[i]])  # stable: shuffled within a prompt
        batch: list[int] = []
        used = 0
        for index in order:
            new_prompt = (
                prompts is not None and bool(batch) and prompts[index] != prompts[batch[-1]]
            )
            if batch and (used + lengths[index] > batch_tokens or new_prompt):
                plan.append(batch)
                batch, used = [], 0
            batch.append(index)
            used += lengths[index]
        plan.append(batch)
        epoch += 1
    return plan[:num_steps] if num_steps is not None else plan
