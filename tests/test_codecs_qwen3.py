"""The Qwen3 codec against our transcription of Qwen3's chat template (``qwen3.jinja``)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codecs_common import (
    assistant_messages,
    decode,
    episodes,
    flatten,
    make_tokenizer,
    masked_runs,
    template_ids,
    template_text,
)

from post_training_cookbook.codecs import QWEN3_CHAT_TEMPLATE, Qwen3Codec, infer_codec
from post_training_cookbook.codecs.qwen3 import EMPTY_THINK
from post_training_cookbook.types import Message

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)


def qwen3(enable_thinking: bool = True) -> Qwen3Codec:
    """Encoding as the template does (see test_codecs.hermes)."""
    codec = Qwen3Codec(make_tokenizer(QWEN3_CHAT_TEMPLATE), enable_thinking=enable_thinking)
    codec.control_tokens_in_content = True
    return codec


def tokens_of(codec: Qwen3Codec, text: str) -> list[int]:
    return list(codec.tokenizer(text, add_special_tokens=False)["input_ids"])


def last_query_index(messages: list[Message]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].get("content", "")
        wrapped = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if messages[index]["role"] == "user" and not wrapped:
            return index
    return len(messages) - 1


def template_keeps_every_think_block(messages: list[Message]) -> bool:
    """Whether the template renders each assistant turn with its reasoning, as sampled."""
    query = last_query_index(messages)
    return all(
        index > query and (index == len(messages) - 1 or message.get("reasoning_content"))
        for index, message in enumerate(messages)
        if message["role"] == "assistant"
    )


@PROPERTY
@given(episode=episodes(reasoning=True), cut=st.integers(min_value=1), thinking=st.booleans())
def test_render_prompt_equals_the_qwen3_template_with_thinking_on_or_off(episode, cut, thinking):
    opening, turns, tools = episode
    messages = flatten(opening, turns)
    messages = messages[: 1 + cut % len(messages)]
    codec = qwen3(thinking)
    expected = template_ids(
        codec, messages, tools, generation_prompt=True, enable_thinking=thinking
    )
    assert codec.render_prompt(messages, tools) == expected


@PROPERTY
@given(episode=episodes(reasoning=True))
def test_with_thinking_the_codec_keeps_reasoning_and_matches_the_template_where_it_keeps_it(
    episode,
):
    opening, turns, tools = episode
    codec = qwen3(True)
    tokens = codec.render_prompt(opening, tools)
    history = list(opening)
    sampled_texts: list[str] = []
    for assistant, after in turns:
        history.append(assistant)
        ids, mask = codec.render_conversation(history, tools)
        sampled = masked_runs(ids, mask)[-1]
        assert decode(codec, sampled).startswith("<think>\n")
        sampled_texts.append(decode(codec, sampled))
        tokens += sampled + codec.render_extension(after, sampled_tokens=sampled)
        history += after
        expected = template_ids(codec, history, tools, generation_prompt=True)
        if template_keeps_every_think_block(history):
            assert tokens == expected
        else:
            assert tokens != expected
            stripped = template_text(codec, history, tools, add_generation_prompt=True)
            assert stripped.count("<think>") < len(sampled_texts)
        text = decode(codec, tokens)
        position = 0
        for sampled_text in sampled_texts:
            position = text.index(sampled_text, position) + len(sampled_text)


@PROPERTY
@given(episode=episodes())
def test_without_thinking_the_codec_keeps_the_forced_empty_think_block_of_every_turn(episode):
    opening, turns, tools = episode
    codec = qwen3(False)
    tokens = codec.render_prompt(opening, tools)
    history = list(opening)
    for assistant, after in turns:
        history.append(assistant)
        ids, mask = codec.render_conversation(history, tools)
        sampled = masked_runs(ids, mask)[-1]
        assert not decode(codec, sampled).startswith("<think>")
        tokens += sampled + codec.render_extension(after, sampled_tokens=sampled)
        history += after
        text = template_text(
            codec, history, tools, add_generation_prompt=True, enable_thinking=False
        )
        as_sampled = re.sub(
            r"<\|im_start\|>assistant\n(?!<think>)", "<|im_start|>assistant\n" + EMPTY_THINK, text
        )
        assert tokens == tokens_of(codec, as_sampled)


@PROPERTY
@given(message=assistant_messages(reasoning=True))
def test_parse_recovers_reasoning_content_and_tool_calls_from_a_rendered_turn(message):
    codec = qwen3(True)
    ids, mask = codec.render_conversation([Message(role="user", content="hi"), message])
    parsed = codec.parse(masked_runs(ids, mask)[-1])
    assert parsed.message is not None, parsed.error
    assert parsed.message["reasoning_content"] == message.get("reasoning_content", "")
    assert parsed.message["content"] == message["content"]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", [])
    ]
    parsed_calls = parsed.message.get("tool_calls", [])
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed_calls
    ] == calls


@PROPERTY
@given(episode=episodes(reasoning=True), thinking=st.booleans())
def test_render_conversation_follows_the_template_and_masks_what_the_model_samples(
    episode, thinking
):
    opening, turns, tools = episode
    messages = flatten(opening, turns)
    if not thinking:
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]  # type: ignore[misc]
    codec = qwen3(thinking)
    ids, mask = codec.render_conversation(messages, tools)
    assert ids == template_ids(codec, messages, tools, generation_prompt=False)
    rendered_turns = ASSISTANT_TURN.findall(template_text(codec, messages, tools))
    if not thinking:
        rendered_turns = [turn.removeprefix(EMPTY_THINK) for turn in rendered_turns]
    assert [decode(codec, run) for run in masked_runs(ids, mask)] == rendered_turns


# ---- the break, spelled out ----


def test_a_new_user_turn_drops_earlier_reasoning_from_the_template_but_not_from_the_codec():
    codec = qwen3(True)
    user = Message(role="user", content="What is 2+2?")
    answer = Message(role="assistant", content="4", reasoning_content="2 plus 2 is 4.")
    follow_up = Message(role="user", content="And 3+3?")
    sampled = tokens_of(codec, "<think>\n2 plus 2 is 4.\n</think>\n\n4<|im_end|>")
    tokens = codec.render_prompt([user]) + sampled
    tokens += codec.render_extension([follow_up], sampled_tokens=sampled)
    assert "2 plus 2 is 4." in decode(codec, tokens)
    rerendered = template_text(codec, [user, answer, follow_up], None, add_generation_prompt=True)
    assert "2 plus 2 is 4." not in rerendered
    assert decode(codec, tokens) == rerendered.replace(
        "<|im_start|>assistant\n4", "<|im_start|>assistant\n<think>\n2 plus 2 is 4.\n</think>\n\n4"
    )


def test_thinking_off_ends_the_generation_prompt_with_the_empty_think_block():
    codec = qwen3(False)
    text = decode(codec, codec.render_prompt([Message(role="user", content="hi")]))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert decode(codec, codec.render_extension([], sampled_tokens=[])).endswith(EMPTY_THINK)


def test_reasoning_written_inside_the_content_renders_like_reasoning_content():
    codec = qwen3(True)
    user = Message(role="user", content="q")
    inline = Message(role="assistant", content="<think>\nr\n</think>\n\nanswer")
    separate = Message(role="assistant", content="answer", reasoning_content="r")
    assert codec.render_conversation([user, inline]) == codec.render_conversation([user, separate])
    assert codec.render_prompt([user, inline]) == template_ids(
        codec, [user, inline], None, generation_prompt=True
    )


# ---- parsing ----


def parse_text(codec: Qwen3Codec, text: str):
    return codec.parse(tokens_of(codec, text + "<|im_end|>"))


def test_parse_splits_reasoning_from_content_and_calls():
    parsed = parse_text(
        qwen3(),
        "<think>\nI should look it up.\n</think>\n\nChecking.\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"k": "v"}}\n</tool_call>',
    )
    assert parsed.message is not None
    assert parsed.message["reasoning_content"] == "I should look it up."
    assert parsed.message["content"] == "Checking."
    assert parsed.message["tool_calls"][0]["function"] == {
        "name": "lookup",
        "arguments": '{"k": "v"}',
    }


def test_tool_call_tags_inside_the_reasoning_are_not_calls():
    parsed = parse_text(qwen3(), "<think>\nmaybe <tool_call> {broken\n</think>\n\nNo call needed.")
    assert parsed.message == {
        "role": "assistant",
        "content": "No call needed.",
        "reasoning_content": "maybe <tool_call> {broken",
    }


def test_an_unterminated_think_block_is_a_parse_error():
    parsed = parse_text(qwen3(), "<think>\nstill thinking when the budget ran out")
    assert not parsed.ok and parsed.error is not None and "unterminated <think>" in parsed.error


def test_a_sample_without_think_tags_has_no_reasoning_content():
    parsed = parse_text(qwen3(False), "Hello.")
    assert parsed.message == {"role": "assistant", "content": "Hello."}


def test_infer_codec_picks_qwen3_for_a_template_with_think_tags():
    codec = infer_codec(make_tokenizer(QWEN3_CHAT_TEMPLATE))
    assert isinstance(codec, Qwen3Codec) and codec.enable_thinking and codec.name == "qwen3"


@pytest.mark.parametrize("thinking", [True, False])
def test_a_length_capped_sample_is_closed_with_a_forced_stop_token(thinking):
    codec = qwen3(thinking)
    capped = tokens_of(codec, "<think>\nhalf a thou")
    extension = codec.render_extension([Message(role="user", content="?")], sampled_tokens=capped)
    assert decode(codec, extension).startswith("<|im_end|>\n<|im_start|>user\n?")


EDGE_CONVERSATIONS = {
    "no user query at all": [
        Message(role="system", content="s"),
        Message(role="assistant", content="a", reasoning_content="r"),
        Message(role="tool", content="t"),
    ],
    "a user turn that only wraps tool responses is not a query": [
        Message(role="user", content="q"),
        Message(role="assistant", content="a", reasoning_content="r1"),
        Message(role="user", content="<tool_response>\nx\n</tool_response>"),
        Message(role="assistant", content="b", reasoning_content="r2"),
    ],
    "newlines around reasoning and content are trimmed": [
        Message(role="user", content="q"),
        Message(role="assistant", content="\n\nc\n", reasoning_content="\n\nr\n\n"),
        Message(role="tool", content="t"),
        Message(role="assistant", content="\nd"),
    ],
    "empty reasoning mid-conversation loses its block": [
        Message(role="user", content="q"),
        Message(role="assistant", content="", reasoning_content=""),
        Message(role="tool", content="t"),
        Message(role="assistant", content="x", reasoning_content="r"),
    ],
}


@pytest.mark.parametrize("messages", EDGE_CONVERSATIONS.values(), ids=EDGE_CONVERSATIONS.keys())
@pytest.mark.parametrize("thinking", [True, False])
def test_edge_conversations_render_like_the_template(messages, thinking):
    codec = qwen3(thinking)
    kwargs = {"enable_thinking": thinking}
    for end in range(1, len(messages) + 1):
        prefix = messages[:end]
        assert codec.render_prompt(prefix) == template_ids(
            codec, prefix, None, generation_prompt=True, **kwargs
        )
        ids, _ = codec.render_conversation(prefix)
        assert ids == template_ids(codec, prefix, None, generation_prompt=False)
