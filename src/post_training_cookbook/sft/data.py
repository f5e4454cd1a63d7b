"""SFT data: conversations (read and checked in ``conversations.py``) rendered and batched.

The model's codec renders each conversation with the env's tools and marks the tokens the
model would have sampled (each assistant turn's body and its stop token); those are the
trained tokens (``train_on="all"``), or only the last assistant turn's (``"last"``). A
conversation longer than ``max_model_length`` is skipped and counted, never cut; one whose
text alone holds more characters than ``max_model_length`` tokens could spell (the
tokenizer's longest vocabulary entry a token) is skipped before it is tokenized, so a 100 MB
conversation costs a count of its characters, not a tokenization.
"""

from __future__ import annotations

import hashlib
import json
import random
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from post_training_cookbook.codecs import Codec
from post_training_cookbook.sft.conversations import Conversation, SFTDataError
from post_training_cookbook.trainer.types import TrainingSample


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
