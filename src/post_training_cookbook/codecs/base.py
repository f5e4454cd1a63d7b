"""The codec interface: chat messages + tool specs ↔ token ids, token-in-token-out.

A codec owns one chat format (a model family). The rollout uses it like this:

    tokens = codec.render_prompt(messages, tools)             # forced, mask 0
    sampled = <the engine samples, stopping at codec.stop_token_ids>
    parsed = codec.parse(sampled)                              # -> the assistant Message
    tokens += sampled                                          # kept as sampled, mask 1
    tokens += codec.render_extension(new_messages, sampled_tokens=sampled)   # forced, mask 0

Earlier tokens are never decoded and re-encoded. ``render_conversation`` is the other
direction, for supervised data: a finished conversation rendered as the chat template
renders it, with a mask on the tokens the model would have sampled.
"""

from __future__ import annotations

import abc
import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.types import Message, ToolSpec


@dataclass(frozen=True)
class ParsedMessage:
    """The assistant message parsed from sampled tokens, or why it could not be parsed."""

    message: Message | None
    """The assistant ``Message``: content, ``tool_calls`` with fresh ids and JSON-string
    arguments, and ``reasoning_content`` for thinking models. ``None`` when parsing failed."""
    error: str | None = None
    """Why parsing failed; the rollout turns it into a ``PARSE_FAILURE`` truncation."""

    @property
    def ok(self) -> bool:
        return self.message is not None


class Codec(abc.ABC):
    """One chat format: renders messages to token ids and parses sampled ids into a message."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    options: ClassVar[Mapping[str, tuple[object, ...]]] = {}
    """The template switches a run may set (``enable_thinking`` ...), each with its allowed
    values; ``models.check_codec_options`` checks a config's choices against them."""
    control_tokens_in_content: bool = False
    """False (the default): text in a message that spells a control token (``<|im_end|>``
    in a tool result, a user prompt or task data) is encoded as that plain text, so a tool
    that returns a web page cannot forge turn boundaries in the training data. True: such
    text becomes the control token, as ``apply_chat_template`` would make it."""

    _stop_token_ids: tuple[int, ...]
    """Set by each codec's constructor; read through ``stop_token_ids``."""

    def _protected(self, messages: Iterable[Message]) -> list[str]:
        """The texts of ``messages`` whose control-token spellings stay plain text (none when
        ``control_tokens_in_content``)."""
        return [] if self.control_tokens_in_content else message_texts(messages)

    def _encode_rendered(self, text: str, messages: Iterable[Message]) -> list[int]:
        """The ids of ``text``, rendered from ``messages``, their contents protected."""
        return encode_text(self.tokenizer, text, self._protected(messages))

    def _encode_conversation(
        self, segments: list[Segment], messages: Iterable[Message]
    ) -> tuple[list[int], list[int]]:
        """``encode_segments`` of a conversation rendered from ``messages``, their contents
        protected: what ``render_conversation`` returns."""
        return encode_segments(self.tokenizer, segments, self._protected(messages))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn; the engine stops sampling on any of them."""
        return self._stop_token_ids

    @abc.abstractmethod
    def render_prompt(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        """The conversation so far plus the generation prompt, as the chat template renders it."""

    @abc.abstractmethod
    def render_extension(
        self, new_messages: list[Message], *, sampled_tokens: list[int]
    ) -> list[int]:
        """The forced tokens to append after an assistant turn sampled as ``sampled_tokens``.

        They are: the glue that closes that turn (plus its stop token if the sample was cut
        by ``max_tokens``), the new non-assistant messages, and the next generation prompt.
        """

    @abc.abstractmethod
    def parse(
        self, sampled_tokens: list[int], tools: list[ToolSpec] | None = None
    ) -> ParsedMessage:
        """The assistant message in ``sampled_tokens``; never raises on model output.

        ``tools``: the tool schemas the prompt showed. Formats that print argument values as
        bare text (the XML calls of Qwen3.5 and later) need them to type each value; without
        them a value that reads as JSON is taken as JSON. JSON formats ignore them.
        """

    @abc.abstractmethod
    def render_conversation(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[int]]:
        """A whole conversation as the chat template renders it, and its assistant mask.

        The mask is 1 exactly on the tokens the model would have sampled: each assistant
        turn's body and its closing stop token, not the ``assistant`` header. The ids are
        the token-in-token-out sequence, equal to ``apply_chat_template`` of the conversation
        for tokenizers that break pre-tokens after ``assistant\\n`` (see ``encode_segments``).
        """


Segment = tuple[str, bool]
"""A piece of rendered text and whether the model samples it (True) or it is forced."""


def encode_segments(
    tokenizer: PreTrainedTokenizerBase, segments: list[Segment], protected: Sequence[str] = ()
) -> tuple[list[int], list[int]]:
    """Token ids of the segments and their mask, each run of forced or sampled text encoded alone.

    Encoding run by run gives exactly the token-in-token-out sequence: a prompt's tokens,
    then the sampled tokens as the model emits them, then an extension's tokens. It equals
    the tokenization of the joined text (what ``apply_chat_template`` returns) whenever the
    tokenizer breaks pre-tokens where a run starts: always at special tokens, and at
    ``assistant\\n`` → content for GPT-2/Qwen-style pre-tokenizer regexes unless the
    content itself starts with whitespace and a newline. Tokenizers without such a regex
    may merge across that boundary; then only this encoding matches what sampling sees.
    ``protected``: message texts whose control-token spellings stay plain text
    (``encode_text``).
    """
    ids: list[int] = []
    mask: list[int] = []
    for sampled, run in itertools.groupby(segments, key=lambda segment: segment[1]):
        text = "".join(piece for piece, _ in run)
        run_ids = encode_text(tokenizer, text, () if sampled else protected) if text else []
        ids += run_ids
        mask += [int(sampled)] * len(run_ids)
    return ids, mask


def message_texts(messages: Iterable[Message]) -> list[str]:
    """Every text of ``messages`` that the chat template copies into the prompt."""
    texts: list[str] = []
    for message in messages:
        for key in ("content", "reasoning_content"):
            value = message.get(key)
            if isinstance(value, str) and value:
                texts.append(value)
        for call in message.get("tool_calls") or []:
            arguments = call.get("function", {}).get("arguments")
            if isinstance(arguments, str) and arguments:
                texts.append(arguments)
    return texts


def encode_text(
    tokenizer: PreTrainedTokenizerBase, text: str, protected: Sequence[str] = ()
) -> list[int]:
    """The ids of rendered ``text``. Where a ``protected`` text (a message's content) spells a
    control token, that stretch of ``text`` is encoded with control tokens as plain text; the
    template's own glue keeps its control tokens. Text without such spellings (nearly all) is
    encoded whole, as the template's tokenization."""
    controls = _control_strings(tokenizer) if protected else []
    risky = [piece for piece in protected if any(control in piece for control in controls)]
    spans = _protected_spans(text, risky)
    if not spans:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids: list[int] = []
    cursor = 0
    for start, end in spans:
        if cursor < start:
            ids += tokenizer(text[cursor:start], add_special_tokens=False)["input_ids"]
        ids += _plain_ids(tokenizer, text[start:end], controls)
        cursor = end
    if cursor < len(text):
        ids += tokenizer(text[cursor:], add_special_tokens=False)["input_ids"]
    return ids


def _control_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings = {str(t) for t in tokenizer.all_special_tokens}
    strings |= {token.content for token in added.values() if getattr(token, "special", False)}
    return sorted((s for s in strings if s), key=len, reverse=True)


def _protected_spans(text: str, protected: Sequence[str]) -> list[tuple[int, int]]:
    """Where each protected text occurs in ``text`` as the template put it there (as it is,
    stripped, or JSON-escaped as Llama's template passes tool results), overlapping spans
    merged."""
    spans: list[tuple[int, int]] = []
    for piece in protected:
        forms = (
            piece,
            piece.strip(),
            json.dumps(piece, ensure_ascii=False)[1:-1],
            json.dumps(piece)[1:-1],
        )
        for candidate in dict.fromkeys(form for form in forms if form):
            found = [match.start() for match in re.finditer(re.escape(candidate), text)]
            spans += [(start, start + len(candidate)) for start in found]
            if found:
                break
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _plain_ids(tokenizer: PreTrainedTokenizerBase, text: str, controls: list[str]) -> list[int]:
    """``text`` encoded with every control-token spelling cut into single characters, so no
    control token id can come out of it (not even from a vocabulary whose ordinary merges
    spell one)."""
    pattern = "(" + "|".join(re.escape(control) for control in controls) + ")"
    ids: list[int] = []
    for index, piece in enumerate(re.split(pattern, text)):
        if not piece:
            continue
        if index % 2:  # a control-token spelling
            for character in piece:
                ids += tokenizer(character, add_special_tokens=False)["input_ids"]
        else:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids
