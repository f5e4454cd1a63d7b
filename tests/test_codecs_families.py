"""Every family codec against its model's real chat template, over 1,000 conversations each.

The oracles are TRL's byte-identical copies of the templates (``real_template``, hash-pinned).
For each random conversation (system or not, several user turns, parallel tool calls, tool
results, unicode and JSON-looking text, reasoning, typed parameter values) and each drawn
set of codec options, ``check_episode`` asserts that the text of the codec's tokens equals
the template's ``apply_chat_template`` text: the whole conversation, the first prompt, and
the token-in-token-out sequence turn by turn (prompt + sampled turn + extension), exactly
where the template keeps earlier turns as they were and with the known difference where it
does not; and that parsing each sampled turn gives back its tool calls, values typed as
they were, and a message the template renders identically.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
from test_codecs_common import (
    flatten,
    make_tokenizer,
    masked_runs,
    random_episode,
    real_template,
)

from post_training_cookbook.codecs import (
    Codec,
    TemplateCodec,
    get_codec,
    infer_codec,
    to_template_messages,
)
from post_training_cookbook.codecs.template import template_messages
from post_training_cookbook.types import Message, ToolSpec

SIZES = [
    pytest.param(150, id="150"),
    pytest.param(1000, id="1000", marks=pytest.mark.heavy),
]
"""Random conversations per family: 150 in the default suite, 1,000 in the heavy step
(about 20 s per family on a shared 2-core machine)."""
THINK_BLOCK = re.compile(r"<\|im_start\|>assistant\n<think>\n.*?</think>\n\n", re.S)


def template_text(
    codec: Codec, messages: list[Message], tools: list[ToolSpec] | None, gen: bool, **kwargs: Any
) -> str:
    convert = template_messages if isinstance(codec, TemplateCodec) else to_template_messages
    text = codec.tokenizer.apply_chat_template(
        convert(messages),
        tools=tools or None,
        add_generation_prompt=gen,
        tokenize=False,
        **kwargs,
    )
    assert isinstance(text, str)
    return text


def text_of(codec: Codec, ids: list[int]) -> str:
    return str(codec.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False))


def canonical_calls(message: Message) -> list[tuple[str, str]]:
    """Each call's name and arguments, types kept apart (1, 1.0 and True print differently).

    Keys are sorted: some templates print arguments in sorted order (Gemma 4); whether the
    order survives is checked by rendering the parsed message again."""
    return [
        (
            call["function"]["name"],
            json.dumps(json.loads(call["function"]["arguments"]), sort_keys=True),
        )
        for call in message.get("tool_calls") or []
    ]


def check_episode(
    codec: Codec,
    episode: tuple[list[Message], list[tuple[Message, list[Message]]], list[ToolSpec]],
    kwargs: dict[str, Any],
    stops: tuple[str, ...],
    dropped_turns: Callable[[list[Message]], list[bool]] | None = None,
) -> None:
    """The properties above for one conversation.

    ``stops``: the texts that end a sampled turn. ``dropped_turns(history)``: for each
    assistant turn, whether the template drops its ``<think>`` block from the history
    (None: the template keeps every turn as it was rendered).
    """
    opening, turns, tools = episode
    messages = flatten(opening, turns)

    def render(history: list[Message], gen: bool) -> str:
        return template_text(codec, history, tools, gen, **kwargs)

    ids, mask = codec.render_conversation(messages, tools)
    assert text_of(codec, ids) == render(messages, False)
    runs = [text_of(codec, run) for run in masked_runs(ids, mask)]
    assistants = sum(m["role"] == "assistant" for m in messages)
    if isinstance(codec, TemplateCodec):  # Gemma 4 runs consecutive assistant turns together
        assert 1 <= len(runs) <= assistants
    else:
        assert len(runs) == assistants

    tokens = codec.render_prompt(opening, tools)
    assert text_of(codec, tokens) == render(opening, True)
    history = list(opening)
    for assistant, after in turns:
        prompt, rendered = render(history, True), render([*history, assistant], False)
        if rendered.startswith(prompt):
            start = len(prompt)
        else:  # the template re-rendered the turn before (Qwen3: two assistant turns in a row)
            generation_prompt = prompt.removeprefix(render(history, False))
            start = rendered.rindex(generation_prompt) + len(generation_prompt)
        end = min((rendered.find(s, start) + len(s), s) for s in stops if s in rendered[start:])
        sampled_text = rendered[start : end[0]]
        sampled = list(codec.tokenizer(sampled_text, add_special_tokens=False)["input_ids"])
        parsed = codec.parse(sampled, tools)
        assert parsed.message is not None, parsed.error
        assert canonical_calls(parsed.message) == canonical_calls(assistant)
        assert render([*history, parsed.message], False) == rendered
        tokens += sampled + codec.render_extension(after, sampled_tokens=sampled)
        history += [assistant, *after]
        expected, ours = render(history, True), text_of(codec, tokens)
        dropped = dropped_turns(history) if dropped_turns else []
        if not any(dropped):
            assert ours == expected
        else:  # the template dropped those turns' think blocks; the codec kept them
            assert ours != expected
            assert drop_think_blocks(ours, dropped) == expected
    if not (dropped_turns and dropped_turns(messages)[-1]):
        assert runs[-1].endswith(sampled_text)  # ==, but for runs of assistant turns (Gemma 4)
        assert runs[-1] == sampled_text or isinstance(codec, TemplateCodec)


def drop_think_blocks(text: str, dropped: list[bool]) -> str:
    """``text`` with the think blocks of the turns flagged in ``dropped`` taken out."""
    flags = iter(dropped)
    return THINK_BLOCK.sub(
        lambda m: "<|im_start|>assistant\n" if next(flags, False) else m.group(0), text
    )


def last_query(messages: list[Message], strip: bool) -> int:
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].get("content") or ""
        content = content.strip() if strip else content
        wrapped = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if messages[index]["role"] == "user" and not wrapped:
            return index
    return len(messages) - 1


def for_each_conversation(
    name: str, conversations: int, check: Callable[[random.Random], None]
) -> None:
    """``check`` with that many seeded generators; a failure names its seed."""
    for seed in range(conversations):
        try:
            check(random.Random(f"{name}/{seed}"))
        except Exception as error:
            error.add_note(f"conversation: random.Random({name + '/' + str(seed)!r})")
            raise


def draw_options(rng: random.Random, choices: dict[str, list[Any]]) -> dict[str, Any]:
    """Codec options drawn from ``choices``; a None draw means "not given" (the default)."""
    drawn = {name: rng.choice(values) for name, values in choices.items()}
    return {name: value for name, value in drawn.items() if value is not None}


# ---- Qwen2.5 / Qwen3 / Qwen3-2507: Hermes JSON calls ----


@pytest.mark.parametrize("conversations", SIZES)
def test_hermes_renders_like_the_real_qwen25_template(conversations):
    codec = get_codec("qwen2.5", make_tokenizer(real_template("qwen2_5")))
    assert infer_codec(codec.tokenizer).name == "hermes"
    for_each_conversation(
        "qwen2.5",
        conversations,
        lambda rng: check_episode(codec, random_episode(rng), {}, ("<|im_end|>",)),
    )


@pytest.mark.parametrize("conversations", SIZES)
def test_qwen3_2507_renders_like_the_real_qwen3_instruct_2507_template(conversations):
    codec = get_codec("qwen3-2507", make_tokenizer(real_template("qwen3_instruct_2507")))
    for_each_conversation(
        "qwen3-2507",
        conversations,
        lambda rng: check_episode(codec, random_episode(rng), {}, ("<|im_end|>",)),
    )


def qwen3_dropped(history: list[Message]) -> list[bool]:
    query = last_query(history, strip=False)
    last = len(history) - 1
    return [
        not (index > query and (index == last or message.get("reasoning_content")))
        for index, message in enumerate(history)
        if message["role"] == "assistant"
    ]


@pytest.mark.parametrize("conversations", SIZES)
def test_qwen3_renders_like_the_real_qwen3_template(conversations):
    tokenizer = make_tokenizer(real_template("qwen3"))
    assert infer_codec(tokenizer).name == "qwen3"

    def check(rng: random.Random) -> None:
        thinking = rng.random() < 0.5
        codec = get_codec("qwen3", tokenizer, enable_thinking=thinking)
        episode = random_episode(rng, reasoning=thinking)
        check_episode(codec, episode, {"enable_thinking": thinking}, ("<|im_end|>",), qwen3_dropped)

    for_each_conversation("qwen3", conversations, check)


# ---- Qwen3.5 / 3.6 / 3.8: XML calls, thinking in the prompt ----


def qwen35_dropped(preserve: bool) -> Callable[[list[Message]], list[bool]]:
    def dropped(history: list[Message]) -> list[bool]:
        query = last_query(history, strip=True)
        return [
            not preserve and index <= query
            for index, message in enumerate(history)
            if message["role"] == "assistant"
        ]

    return dropped


QWEN35_FAMILIES = {
    # codec: (template file, the options a run may set and their values; None: not given)
    "qwen3.5": ("qwen3_5_think", {"enable_thinking": [None, True, False]}),
    "qwen3.5-nothink": ("qwen3_5_nothink", {"enable_thinking": [None, True, False]}),
    "qwen3.6": (
        "qwen3_6",
        {"enable_thinking": [None, True, False], "preserve_thinking": [None, True, False]},
    ),
    "qwen3.8": (
        "qwen3_8",
        {
            "enable_thinking": [None, True, False],
            "preserve_thinking": [None, True, False],
            "reasoning_effort": [None, "xhigh", "medium", "low"],
        },
    ),
}


@pytest.mark.parametrize("conversations", SIZES)
@pytest.mark.parametrize("name", QWEN35_FAMILIES)
def test_the_xml_families_render_like_their_real_templates(name, conversations):
    template_file, choices = QWEN35_FAMILIES[name]
    tokenizer = make_tokenizer(real_template(template_file))
    assert infer_codec(tokenizer).name == name

    def check(rng: random.Random) -> None:
        chosen = draw_options(rng, choices)
        codec = get_codec(name, tokenizer, **chosen)
        thinking = codec.enable_thinking  # type: ignore[attr-defined]
        preserve = codec.preserve_thinking  # type: ignore[attr-defined]
        episode = random_episode(
            rng, reasoning=thinking, typed=True, system_follow_ups=False, strip_content=False
        )
        check_episode(codec, episode, chosen, ("<|im_end|>",), qwen35_dropped(preserve))

    for_each_conversation(name, conversations, check)


# ---- Llama 3.1 / 3.2: one JSON call, ipython results ----


@pytest.mark.parametrize(
    ("name", "template_file"), [("llama3.1", "llama3_1"), ("llama3.2", "llama3_2")]
)
@pytest.mark.parametrize("conversations", SIZES)
def test_the_llama_families_render_like_their_real_templates(name, template_file, conversations):
    tokenizer = make_tokenizer(real_template(template_file), family="llama3")
    assert infer_codec(tokenizer).name == name

    def check(rng: random.Random) -> None:
        chosen = draw_options(rng, {"date_string": [None, "01 Jan 2025"]})
        codec = get_codec(name, tokenizer, **chosen)
        episode = random_episode(rng, max_calls=1, strip_content=False)
        check_episode(codec, episode, chosen, ("<|eot_id|>",))

    for_each_conversation(name, conversations, check)
