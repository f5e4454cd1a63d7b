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
from collections.abc import Mapping
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

    @property
    @abc.abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn; the engine stops sampling on any of them."""

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
    tokenizer: PreTrainedTokenizerBase, segments: list[Segment]
) -> tuple[list[int], list[int]]:
    """Token ids of the segments and their mask, each run of forced or sampled text encoded alone.

    Encoding run by run gives exactly the token-in-token-out sequence: a prompt's tokens,
    then the sampled tokens as the model emits them, then an extension's tokens. It equals
    the tokenization of the joined text (what ``apply_chat_template`` returns) whenever the
    tokenizer breaks pre-tokens where a run starts: always at special tokens, and at
    ``assistant\\n`` → content for GPT-2/Qwen-style pre-tokenizer regexes unless the
    content itself starts with whitespace and a newline. Tokenizers without such a regex
    may merge across that boundary; then only this encoding matches what sampling sees.
    """
    ids: list[int] = []
    mask: list[int] = []
    for sampled, run in itertools.groupby(segments, key=lambda segment: segment[1]):
        text = "".join(piece for piece, _ in run)
        run_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        ids += run_ids
        mask += [int(sampled)] * len(run_ids)
    return ids, mask
