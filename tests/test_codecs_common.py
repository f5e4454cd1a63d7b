"""Shared pieces of the codec tests: a tokenizer trained here, and random conversations.

No tests live here; the ``test_codecs_*`` modules import it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest
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
# ---- the real chat templates, from TRL's byte-identical copies ----

REAL_TEMPLATES = {
    # file in trl/chat_templates (TRL 1.16.0): (sha256, the model repository it is copied from)
    "qwen2_5": ("cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f", "Qwen2.5"),
    "qwen3": ("a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8", "Qwen3"),
    "qwen3_instruct_2507": (
        "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
        "Qwen/Qwen3-4B-Instruct-2507",
    ),
    "qwen3_5_think": (
        "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
        "Qwen3.5-4B and larger",
    ),
    "qwen3_5_nothink": (
        "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80",
        "Qwen3.5-2B and smaller",
    ),
    "qwen3_6": (
        "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259",
        "Qwen/Qwen3.6-27B, Qwen/Qwen3.6-35B-A3B",
    ),
    "qwen3_8": (
        "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041",
        "Qwen/Qwen3.8-27B",
    ),
    "llama3_1": ("e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65", "Llama 3.1"),
    "llama3_2": ("5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4", "Llama 3.2"),
    "gptoss": ("a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146", "gpt-oss"),
    "gemma4": (
        "33204f1acb5bd0002713e16a593847f24ceeafe711ed88bda2a352dc996a3373",
        "google/gemma-4-E2B-it@6b7e72c",
    ),
    "gemma4_v2": (
        "55572b8d3c8342044e25874c73fe5234b661fa0a57a57f6ef75b58e03d7d959a",
        "google/gemma-4-E2B-it@4742fe8 (release)",
    ),
    "nemotron_3_nano": (
        "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862",
        "nvidia/NVIDIA-Nemotron-3-Nano",
    ),
    "glm4moe": ("44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3", "GLM-4-MoE"),
}
"""The real templates the codec tests use as oracles, pinned by hash (TRL's README names
each file's source repository and revision). TRL is a test-only dependency, installed
without its dependencies (requirements/chat-templates.txt); nothing imports it."""


@functools.cache
def real_template(name: str) -> str:
    """The text of ``trl/chat_templates/{name}.jinja``, checked against its pinned hash."""
    spec = importlib.util.find_spec("trl")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the codec tests read the real chat templates from TRL, a test-only dependency: "
            "pip install --no-deps --require-hashes -r requirements/chat-templates.txt"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / f"{name}.jinja"
    data = path.read_bytes()
    expected, source = REAL_TEMPLATES[name]
    if hashlib.sha256(data).hexdigest() != expected:
        pytest.fail(f"{path} ({source}) is not the pinned copy; install TRL 1.16.0 as pinned")
    return data.decode("utf-8")


FAMILY_TOKENS = {
    "chatml": (SPECIAL_TOKENS, "<|im_end|>", None),
    "llama3": (
        [
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
        ],
        "<|eot_id|>",
        "<|begin_of_text|>",
    ),
    "gptoss": (
        [
            "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
            "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>",
        ],
        "<|return|>",
        "<|startoftext|>",
    ),
    "gemma4": (
        [
            "<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>",
            "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", '<|"|>', "<|channel>",
            "<channel|>", "<|think|>", "<|image|>", "<|audio|>", "<|video|>",
        ],
        "<eos>",
        "<bos>",
    ),
}  # fmt: skip
"""Each chat family's special tokens, EOS and BOS, as its real tokenizer has them."""
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
def trained_tokenizer_json(with_regex: bool, family: str = "chatml") -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    split = [pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated")] if with_regex else []
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*split, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=FAMILY_TOKENS[family][0],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(), trainer)
    return tokenizer.to_str()


@functools.cache
def make_tokenizer(
    chat_template: str, *, with_regex: bool = True, family: str = "chatml"
) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with a family's special tokens and a chat template.

    ``family``: ``chatml`` (ChatML and the Qwen tool tags), ``llama3``, ``gptoss`` or
    ``gemma4`` (``FAMILY_TOKENS``). ``with_regex=False`` drops the pre-tokenizer regex (like
    the bundled model's tokenizer), so BPE merges may cross the ``assistant\\n`` → content
    boundary.
    """
    specials, eos, bos = FAMILY_TOKENS[family]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained_tokenizer_json(with_regex, family)),
        eos_token=eos,
        bos_token=bos,
        pad_token="<|endoftext|>" if family == "chatml" else specials[1],
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
    *dict.fromkeys(token for tokens, _, _ in FAMILY_TOKENS.values() for token in tokens),
    "<tools>",
    "</tools>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<IMPORTANT>",
)
_CHARACTERS = st.characters(
    codec="utf-8",
    exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"),
)
SEPARATORS = [" ", "\n", "\t", "  ", '"', "'", "{", "}", "[", "]", ":", ",", "\\", "```"]
JSON_SNIPPETS = ['{"a": 1}', '{"name": "x"}', "```json\n[1, 2]\n```", '"quoted"', "{}", "null"]
_PIECES = st.one_of(
    st.text(_CHARACTERS, min_size=1, max_size=8),
    st.sampled_from(SEPARATORS),
    st.sampled_from(JSON_SNIPPETS),
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


# ---- seeded random conversations ----
# The same kinds of text and structure as the strategies above, drawn from a seeded
# ``random.Random``: Hypothesis spends ~75 ms drawing one episode, too slow for the 1,000
# conversations per family of ``test_codecs_families``; these take well under 1 ms.

ALPHABET = [
    char
    for start, end in [(0x21, 0x2FF), (0x370, 0x52F), (0x2000, 0x2BFF), (0x3040, 0x30FF),
                       (0x4E00, 0x4EFF), (0xAC00, 0xACFF), (0x1F300, 0x1F64F)]
    for char in map(chr, range(start, end + 1))
    if unicodedata.category(char) not in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")
]  # fmt: skip
"""Printable characters from Latin to emoji, no controls or separators (as ``_CHARACTERS``)."""
JSON_LOOKING_STRINGS = ["42", "true", "None", "null", '{"a": 1}', "[1, 2]", "1.5", " x ", "\nx\n"]
PARAMETER_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
SPECIAL_FLOATS = [0.0, -0.0, 1.5, 3.0, 1e16, 1e-7, 5e-324, -2.5e300, 0.1]


def random_text(rng: random.Random) -> str:
    """Like ``free_text``: unicode, quotes, braces, JSON-ish text, newlines; no template markers."""
    pieces = []
    for _ in range(rng.randint(0, 8)):
        kind = rng.random()
        if kind < 0.4:
            pieces.append("".join(rng.choices(ALPHABET, k=rng.randint(1, 8))))
        elif kind < 0.6:
            pieces.append(rng.choice(WORDS))
        elif kind < 0.85:
            pieces.append(rng.choice(SEPARATORS))
        else:
            pieces.append(rng.choice(JSON_SNIPPETS))
    return _clean("".join(pieces))


def random_identifier(rng: random.Random) -> str:
    first = rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
    rest = "abcdefghijklmnopqrstuvwxyz0123456789_"
    return first + "".join(rng.choices(rest, k=rng.randint(0, 12)))


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """Like ``json_values``: null, booleans, integers, floats, text, and small nests of them."""
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(10**12), 10**12)
    if kind == 3:
        return rng.choice(SPECIAL_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
    if kind == 4:
        return random_text(rng)
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_text(rng): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def random_value(rng: random.Random, kind: str) -> Any:
    """A value of a JSON-schema type; strings include ones that read as JSON."""
    if kind == "string":
        return rng.choice(JSON_LOOKING_STRINGS) if rng.random() < 0.3 else random_text(rng)
    if kind == "integer":
        return rng.randint(-(10**15), 10**15)
    if kind == "number":
        return rng.choice(SPECIAL_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [random_json(rng, 1) for _ in range(rng.randint(0, 3))]
    if kind == "object":
        return {random_text(rng): random_json(rng, 1) for _ in range(rng.randint(0, 3))}
    return None


def random_tools(rng: random.Random, *, typed: bool) -> list[ToolSpec]:
    """Like ``tool_specs``; ``typed``: parameters with printable names and a declared type."""
    tools: list[ToolSpec] = []
    for name in dict.fromkeys(random_identifier(rng) for _ in range(rng.randint(0, 3))):
        if typed:
            names = dict.fromkeys(random_identifier(rng) for _ in range(rng.randint(0, 4)))
            properties = {
                key: {"type": rng.choice(PARAMETER_TYPES), "description": random_text(rng)}
                for key in names
            }
        else:
            properties = {random_text(rng): random_json(rng) for _ in range(rng.randint(0, 4))}
        function = {
            "name": name,
            "description": random_text(rng),
            "parameters": {"type": "object", "properties": properties},
        }
        tools.append({"type": "function", "function": function})  # type: ignore[typeddict-item]
    return tools


def random_call(rng: random.Random, tools: list[ToolSpec] | None) -> ToolCall:
    """Like ``tool_calls``; with ``tools``: a call of one of them, values of their types."""
    style = rng.choice([{}, {"separators": (",", ":")}, {"ensure_ascii": True}])
    if tools:
        function = rng.choice(tools)["function"]
        properties = function["parameters"]["properties"]
        keys = rng.sample(sorted(properties), rng.randint(0, len(properties)))
        arguments = {key: random_value(rng, properties[key]["type"]) for key in keys}
        name = function["name"]
    else:
        arguments = {random_text(rng): random_json(rng) for _ in range(rng.randint(0, 4))}
        name = random_identifier(rng)
    return {
        "id": f"call_{random_identifier(rng)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, **style)},  # type: ignore[arg-type]
    }


def random_episode(
    rng: random.Random,
    *,
    reasoning: bool = False,
    typed: bool = False,
    max_calls: int = 3,
    system_follow_ups: bool = True,
    strip_content: bool = True,
) -> tuple[list[Message], list[tuple[Message, list[Message]]], list[ToolSpec]]:
    """Like ``episodes``: opening messages, (assistant turn, what follows it) pairs, tools.

    ``typed``: tools with typed parameters, and calls of those tools only (formats that print
    values as bare text need the schema). ``max_calls``: tool calls per assistant turn.
    ``system_follow_ups``: whether a system message may follow a turn. ``strip_content``:
    False gives assistant content and reasoning with whitespace at the ends.
    """

    def content() -> str:
        text = random_text(rng)
        return text.strip() if strip_content else text

    opening: list[Message] = []
    if rng.random() < 0.5:
        opening.append(Message(role="system", content=random_text(rng)))
    opening.append(Message(role="user", content=random_text(rng)))
    tools = random_tools(rng, typed=typed)
    turns = []
    for _ in range(rng.randint(1, 4)):
        assistant = Message(role="assistant", content=content())
        calls = [
            random_call(rng, tools if typed else None)
            for _ in range(rng.randint(0, max_calls))
            if tools or not typed
        ]
        if calls:
            assistant["tool_calls"] = calls
        if reasoning and rng.random() < 0.5:
            assistant["reasoning_content"] = content()
        after: list[Message] = [
            Message(role="tool", content=random_text(rng), tool_call_id="call_1",
                    name=random_identifier(rng))
            for _ in range(rng.randint(0, 3))
        ]  # fmt: skip
        if rng.random() < 0.5:
            text = random_text(rng)
            wrapped = rng.random() < 0.3
            after.append(
                Message(
                    role="user",
                    content=f"<tool_response>\n{text}\n</tool_response>" if wrapped else text,
                )
            )
        if system_follow_ups and rng.random() < 0.1:
            after.append(Message(role="system", content=random_text(rng)))
        turns.append((assistant, after))
    return opening, turns, tools
