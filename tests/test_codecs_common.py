"""Shared pieces of the codec tests: a tokenizer trained here, and random conversations.

No tests live here; the ``test_codecs_*`` modules import it.
"""

from __future__ import annotations

import functools
import json
import random
import unicodedata
from typing import Any

from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from post_training_cookbook.codecs import Codec, to_template_messages
from post_training_cookbook.types import Message, ToolCall, ToolSpec

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
# Qwen2's pre-tokenizer pattern: words, single digits, punctuation runs, newline runs.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
WORDS = [
    "the", "answer", "is", "lookup", "calculator", "city", "Paris", "café", "naïve", "日本語",
    "Привет", "🎉", "x", "value", "true", "null", "arguments", "name", "result", "42", "3.14",
]  # fmt: skip


def _training_lines() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        words = rng.choices(WORDS, k=rng.randint(3, 12))
        lines.append(" ".join(words))
        lines.append("assistant\n" + " ".join(words[:2]))
        lines.append(json.dumps({rng.choice(WORDS): rng.choice(WORDS)}, ensure_ascii=False))
    lines.append("# Tools\n\nYou may call one or more functions to assist with the user query.")
    lines.append('<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call>')
    lines.append("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>\n")
    return lines


@functools.cache
def trained_tokenizer_json(with_regex: bool) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    split = [pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated")] if with_regex else []
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*split, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(), trainer)
    return tokenizer.to_str()


@functools.cache
def make_tokenizer(chat_template: str, *, with_regex: bool = True) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with the ChatML/tool special tokens and a template.

    ``with_regex=False`` drops the pre-tokenizer regex (like the bundled model's tokenizer),
    so BPE merges may cross the ``assistant\\n`` → content boundary.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained_tokenizer_json(with_regex)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


def template_ids(
    codec: Codec,
    messages: list[Message],
    tools: list[ToolSpec] | None,
    *,
    generation_prompt: bool,
    **template_kwargs: Any,
) -> list[int]:
    """What ``apply_chat_template`` of the tokenizer's template gives for the conversation."""
    ids = codec.tokenizer.apply_chat_template(
        to_template_messages(messages),
        tools=tools or None,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    return list(ids)


def template_text(
    codec: Codec, messages: list[Message], tools: list[ToolSpec] | None, **template_kwargs: Any
) -> str:
    text = codec.tokenizer.apply_chat_template(
        to_template_messages(messages), tools=tools or None, tokenize=False, **template_kwargs
    )
    assert isinstance(text, str)
    return text


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of ids whose mask is 1, in order."""
    runs: list[list[int]] = []
    for index, (token, bit) in enumerate(zip(ids, mask, strict=True)):
        if bit and (index == 0 or not mask[index - 1]):
            runs.append([])
        if bit:
            runs[-1].append(token)
    return runs


def decode(codec: Codec, ids: list[int]) -> str:
    return str(codec.tokenizer.decode(ids, skip_special_tokens=False))


# ---- random conversations ----

MARKERS = (
    *SPECIAL_TOKENS,
    "<tools>",
    "</tools>",
)
_CHARACTERS = st.characters(
    codec="utf-8",
    exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"),
)
_PIECES = st.one_of(
    st.text(_CHARACTERS, min_size=1, max_size=8),
    st.sampled_from([" ", "\n", "\t", "  ", '"', "'", "{", "}", "[", "]", ":", ",", "\\", "```"]),
    st.sampled_from(
        ['{"a": 1}', '{"name": "x"}', "```json\n[1, 2]\n```", '"quoted"', "{}", "null"]
    ),
)


def _clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    while any(marker in text for marker in MARKERS):
        for marker in MARKERS:
            text = text.replace(marker, "")
    return text


free_text = st.lists(_PIECES, max_size=8).map("".join).map(_clean)
"""Any content: unicode, quotes, braces, JSON-ish text, newlines; no template markers."""
stripped_text = free_text.map(str.strip)
"""Content as a parser returns it: no whitespace at either end."""

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | free_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(free_text, inner, max_size=3),
    max_leaves=6,
)
argument_objects = st.dictionaries(free_text, json_values, max_size=4)


@st.composite
def tool_calls(draw: st.DrawFn) -> ToolCall:
    """A call whose arguments string is valid JSON, not always in canonical spacing."""
    arguments = draw(argument_objects)
    style = draw(st.sampled_from([{}, {"separators": (",", ":")}, {"ensure_ascii": True}]))
    return {
        "id": f"call_{draw(identifiers)}",
        "type": "function",
        "function": {"name": draw(identifiers), "arguments": json.dumps(arguments, **style)},
    }


@st.composite
def assistant_messages(draw: st.DrawFn, *, reasoning: bool = False) -> Message:
    message = Message(role="assistant", content=draw(stripped_text))
    calls = draw(st.lists(tool_calls(), max_size=3))
    if calls:
        message["tool_calls"] = calls
    if reasoning and draw(st.booleans()):
        message["reasoning_content"] = draw(stripped_text)
    return message


def user_messages() -> st.SearchStrategy[Message]:
    wrapped = free_text.map(lambda text: f"<tool_response>\n{text}\n</tool_response>")
    return st.builds(lambda text: Message(role="user", content=text), free_text | wrapped)


def tool_messages() -> st.SearchStrategy[Message]:
    return st.builds(
        lambda text, name: Message(role="tool", content=text, tool_call_id="call_1", name=name),
        free_text,
        identifiers,
    )


@st.composite
def follow_ups(draw: st.DrawFn) -> list[Message]:
    """What the env appends after an assistant turn: tool results, a user turn, both or none."""
    messages = draw(st.lists(tool_messages(), max_size=3))
    if draw(st.booleans()):
        messages.append(draw(user_messages()))
    if draw(st.integers(0, 9)) == 0:
        messages.append(Message(role="system", content=draw(free_text)))
    return messages


@st.composite
def tool_specs(draw: st.DrawFn) -> list[ToolSpec]:
    names = draw(st.lists(identifiers, max_size=3, unique=True))
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": draw(free_text),
                "parameters": {"type": "object", "properties": draw(argument_objects)},
            },
        }
        for name in names
    ]


@st.composite
def episodes(
    draw: st.DrawFn, *, reasoning: bool = False
) -> tuple[list[Message], list[tuple[Message, list[Message]]], list[ToolSpec]]:
    """Opening messages, (assistant turn, what the env appends after it) pairs, and tools."""
    opening: list[Message] = []
    if draw(st.booleans()):
        opening.append(Message(role="system", content=draw(free_text)))
    opening.append(Message(role="user", content=draw(free_text)))
    turns = draw(
        st.lists(
            st.tuples(assistant_messages(reasoning=reasoning), follow_ups()), min_size=1, max_size=4
        )
    )
    return opening, turns, draw(tool_specs())


def flatten(opening: list[Message], turns: list[tuple[Message, list[Message]]]) -> list[Message]:
    messages = list(opening)
    for assistant, after in turns:
        messages += [assistant, *after]
    return messages


def expected_body(message: Message) -> str:
    """An assistant turn's sampled text, built independently of the codec."""
    content = message.get("content") or ""
    body = content
    for number, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        payload = {"name": function["name"], "arguments": json.loads(function["arguments"])}
        separator = "\n" if content or number else ""
        body += f"{separator}<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"
    return body + "<|im_end|>"
