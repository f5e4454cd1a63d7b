"""The Hermes (Qwen2.5) codec against its chat template, and the codec helpers."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codecs_common import (
    assistant_messages,
    decode,
    episodes,
    expected_body,
    flatten,
    make_tokenizer,
    masked_runs,
    template_ids,
    template_text,
    trained_tokenizer_json,
)
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from post_training_cookbook.codecs import (
    HERMES_CHAT_TEMPLATE,
    QWEN25_DEFAULT_SYSTEM,
    HermesCodec,
    Qwen3Codec,
    get_codec,
    infer_codec,
    to_template_messages,
)
from post_training_cookbook.codecs.qwen3 import THINK_OPEN
from post_training_cookbook.codecs.tool_calls import canonical_arguments
from post_training_cookbook.types import Message

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QWEN25_LIKE_TEMPLATE = (
    f'{{%- set default_system = "{QWEN25_DEFAULT_SYSTEM}" %}}' + HERMES_CHAT_TEMPLATE
)


def hermes(default_system: str | None = None, **options: bool) -> HermesCodec:
    """A codec that encodes as the template does, control-token spellings in message text
    included (the generated texts spell them on purpose; test_codecs_injection checks the
    default, which keeps them plain)."""
    codec = HermesCodec(
        make_tokenizer(HERMES_CHAT_TEMPLATE), default_system=default_system, **options
    )
    codec.control_tokens_in_content = True
    return codec


def tokens_of(codec: HermesCodec, text: str) -> list[int]:
    return list(codec.tokenizer(text, add_special_tokens=False)["input_ids"])


def call(name: str, arguments: str) -> dict[str, object]:
    return {"id": "call_x", "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- properties over random conversations ----


@PROPERTY
@given(
    episode=episodes(),
    cut=st.integers(min_value=1),
    default_system=st.sampled_from([None, QWEN25_DEFAULT_SYSTEM]),
)
def test_render_prompt_equals_the_chat_template_with_a_generation_prompt(
    episode, cut, default_system
):
    opening, turns, tools = episode
    messages = flatten(opening, turns)
    messages = messages[: 1 + cut % len(messages)]
    codec = hermes(default_system)
    expected = template_ids(
        codec, messages, tools, generation_prompt=True, default_system=default_system
    )
    assert codec.render_prompt(messages, tools) == expected


@PROPERTY
@given(episode=episodes(), default_system=st.sampled_from([None, QWEN25_DEFAULT_SYSTEM]))
def test_prompt_plus_sampled_turns_plus_extensions_equals_the_template_turn_by_turn(
    episode, default_system
):
    opening, turns, tools = episode
    codec = hermes(default_system)
    kwargs = {"default_system": default_system}
    tokens = codec.render_prompt(opening, tools)
    history = list(opening)
    for assistant, after in turns:
        history.append(assistant)
        ids, mask = codec.render_conversation(history, tools)
        sampled = masked_runs(ids, mask)[-1]
        tokens += sampled
        assert tokens + tokens_of(codec, "\n") == template_ids(
            codec, history, tools, generation_prompt=False, **kwargs
        )
        tokens += codec.render_extension(after, sampled_tokens=sampled)
        history += after
        assert tokens == template_ids(codec, history, tools, generation_prompt=True, **kwargs)


@PROPERTY
@given(message=assistant_messages())
def test_parse_recovers_content_and_tool_calls_from_a_rendered_assistant_turn(message):
    codec = hermes()
    ids, mask = codec.render_conversation([Message(role="user", content="hi"), message])
    parsed = codec.parse(masked_runs(ids, mask)[-1])
    assert parsed.ok and parsed.message is not None and parsed.error is None
    assert parsed.message["role"] == "assistant"
    assert parsed.message["content"] == message["content"]
    expected_calls = message.get("tool_calls", [])
    parsed_calls = parsed.message.get("tool_calls", [])
    assert [c["function"]["name"] for c in parsed_calls] == [
        c["function"]["name"] for c in expected_calls
    ]
    assert [json.loads(c["function"]["arguments"]) for c in parsed_calls] == [
        json.loads(c["function"]["arguments"]) for c in expected_calls
    ]
    ids_seen = [c["id"] for c in parsed_calls]
    assert len(set(ids_seen)) == len(ids_seen)
    assert not set(ids_seen) & {c["id"] for c in expected_calls}


@PROPERTY
@given(episode=episodes(), default_system=st.sampled_from([None, QWEN25_DEFAULT_SYSTEM]))
def test_render_conversation_masks_exactly_the_assistant_bodies_and_matches_the_template(
    episode, default_system
):
    opening, turns, tools = episode
    messages = flatten(opening, turns)
    codec = hermes(default_system)
    ids, mask = codec.render_conversation(messages, tools)
    assert ids == template_ids(
        codec, messages, tools, generation_prompt=False, default_system=default_system
    )
    runs = masked_runs(ids, mask)
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert [decode(codec, run) for run in runs] == [expected_body(m) for m in assistants]
    forced_text = decode(codec, [t for t, bit in zip(ids, mask, strict=True) if not bit])
    assert forced_text.count("<|im_start|>assistant\n") == len(assistants)


@PROPERTY
@given(episode=episodes())
def test_a_tokenizer_without_a_pretokenizer_regex_still_gets_an_exact_token_in_token_out_sequence(
    episode,
):
    opening, turns, tools = episode
    codec = HermesCodec(make_tokenizer(HERMES_CHAT_TEMPLATE, with_regex=False))
    codec.control_tokens_in_content = True  # as the template encodes them (see hermes())
    assert codec.render_prompt(opening, tools) == template_ids(
        codec, opening, tools, generation_prompt=True
    )
    tokens = codec.render_prompt(opening, tools)
    for assistant, after in turns:
        sampled = tokens_of(codec, expected_body(assistant))
        tokens += sampled + codec.render_extension(after, sampled_tokens=sampled)
    ids, _ = codec.render_conversation(flatten(opening, turns), tools)
    assert tokens[: len(ids)] == ids
    assert decode(codec, tokens) == template_text(
        codec, flatten(opening, turns), tools, add_generation_prompt=True
    )


# ---- rendering details ----


def test_the_template_prints_string_arguments_as_the_json_object_not_a_quoted_string():
    codec = hermes()
    message = Message(role="assistant", content="", tool_calls=[call("f", '{"x": [1, "é"]}')])  # type: ignore[list-item]
    text = codec.tokenizer.apply_chat_template([message], tokenize=False)
    assert '{"name": "f", "arguments": {"x": [1, "é"]}}' in text
    assert text == template_text(codec, [message], None)


def test_tool_call_arguments_are_rendered_canonically_whatever_their_spacing():
    codec = hermes()
    message = Message(role="assistant", content="", tool_calls=[call("f", '{"b":1,"a":"\\u00e9"}')])  # type: ignore[list-item]
    ids, _ = codec.render_conversation([message])
    assert '"arguments": {"b": 1, "a": "é"}}' in decode(codec, ids)
    assert canonical_arguments('{"b":1,"a":"\\u00e9"}') == '{"b": 1, "a": "é"}'
    assert to_template_messages([message])[0]["tool_calls"][0]["function"]["arguments"] == {
        "b": 1,
        "a": "é",
    }


def test_rendering_arguments_that_are_not_a_json_object_raises():
    codec = hermes()
    message = Message(role="assistant", content="", tool_calls=[call("f", "[1, 2]")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="JSON object"):
        codec.render_conversation([message])


def test_the_default_system_prompt_appears_only_without_a_system_message():
    codec = hermes(QWEN25_DEFAULT_SYSTEM)
    user = Message(role="user", content="hi")
    assert decode(codec, codec.render_prompt([user])).startswith(
        f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>"
    )
    own = decode(codec, codec.render_prompt([Message(role="system", content="Be brief."), user]))
    assert QWEN25_DEFAULT_SYSTEM not in own
    assert decode(hermes(None), hermes(None).render_prompt([user])).startswith(
        "<|im_start|>user\nhi"
    )


def test_consecutive_tool_results_share_one_user_turn():
    codec = hermes()
    results = [Message(role="tool", content="1"), Message(role="tool", content="2")]
    sampled = tokens_of(codec, "ok<|im_end|>")
    text = decode(codec, codec.render_extension(results, sampled_tokens=sampled))
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_extension_after_a_length_capped_sample_forces_the_closing_stop_token():
    codec = hermes()
    opening = [Message(role="user", content="count")]
    capped = tokens_of(codec, "one two thr")
    after = [Message(role="user", content="go on")]
    extension = codec.render_extension(after, sampled_tokens=capped)
    im_end = codec.stop_token_ids[0]
    assert extension[0] == im_end
    assert extension[1:] == codec.render_extension(after, sampled_tokens=[*capped, im_end])
    truncated = Message(role="assistant", content="one two thr")
    full = codec.render_prompt(opening) + capped + extension
    assert full == template_ids(codec, [*opening, truncated, *after], None, generation_prompt=True)


def test_render_extension_after_an_end_of_text_stop_also_closes_the_turn():
    codec = hermes()
    end_of_text = codec.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_text in codec.stop_token_ids
    extension = codec.render_extension([], sampled_tokens=[*tokens_of(codec, "done"), end_of_text])
    assert decode(codec, extension) == "<|im_end|>\n<|im_start|>assistant\n"


def test_extensions_refuse_assistant_messages_and_prompts_refuse_empty_conversations():
    codec = hermes()
    with pytest.raises(ValueError, match="non-assistant"):
        codec.render_extension([Message(role="assistant", content="x")], sampled_tokens=[])
    with pytest.raises(ValueError, match="empty"):
        codec.render_prompt([])


def test_stop_tokens_are_im_end_first_then_end_of_text():
    codec = hermes()
    convert = codec.tokenizer.convert_tokens_to_ids
    assert codec.stop_token_ids == (convert("<|im_end|>"), convert("<|endoftext|>"))


# ---- parsing ----


def parse_text(codec: HermesCodec, text: str):
    return codec.parse(tokens_of(codec, text + "<|im_end|>"))


def test_parse_reads_several_tagged_calls_and_keeps_the_text_around_them_as_content():
    codec = hermes()
    parsed = parse_text(
        codec,
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
    )
    assert parsed.message is not None
    assert parsed.message["content"] == "Let me check."
    calls = parsed.message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_of_plain_text_gives_a_message_without_tool_calls():
    parsed = parse_text(hermes(), "  The answer is 4.\n")
    assert parsed.message == {"role": "assistant", "content": "The answer is 4."}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>', "invalid JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '"name"'),
        ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', '"name"'),
        ('<tool_call>\n{"name": "a"}\n</tool_call>', '"arguments"'),
        ('<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>', "must be a JSON object"),
        (
            '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
            "must be a JSON object",
        ),
        ('<tool_call>\n["a", {}]\n</tool_call>', "expected a JSON object"),
        ('<tool_call>\n{"name": "a", "arguments": {}}', "unterminated"),
        ("ok</tool_call>", "without a matching"),
    ],
)
def test_parse_reports_malformed_tool_calls_as_errors_instead_of_raising(text, reason):
    parsed = parse_text(hermes(lenient_json=True), text)
    assert not parsed.ok and parsed.message is None
    assert parsed.error is not None and reason in parsed.error


def test_parse_never_raises_on_arbitrary_token_ids():
    codec = hermes(lenient_json=True)

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.integers(0, len(codec.tokenizer) - 1), max_size=40))
    def check(ids: list[int]) -> None:
        parsed = codec.parse(ids)
        assert parsed.ok != (parsed.error is not None)

    check()


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "lookup", "arguments": {"city": "Paris"}}',
        '```json\n{"name": "lookup", "arguments": {"city": "Paris"}}\n```',
        'Sure.\n```\n{"name": "lookup", "arguments": {"city": "Paris"}}\n```',
    ],
)
def test_lenient_json_takes_bare_or_fenced_call_objects_as_tool_calls(text):
    parsed = parse_text(hermes(lenient_json=True), text)
    assert parsed.message is not None
    assert parsed.message["content"] in ("", "Sure.")
    [tool_call] = parsed.message["tool_calls"]
    assert tool_call["function"] == {"name": "lookup", "arguments": '{"city": "Paris"}'}


def test_lenient_json_reads_several_bare_calls_and_leaves_other_json_as_content():
    text = (
        'Data: {"name": "x"}\n{"name": "a", "arguments": {}}\n'
        '{"name": "b", "arguments": {"n": {"m": 2}}}'
    )
    parsed = parse_text(hermes(lenient_json=True), text)
    assert parsed.message is not None
    assert parsed.message["content"] == 'Data: {"name": "x"}'
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["a", "b"]


def test_lenient_json_rejects_a_bare_call_whose_arguments_are_not_an_object():
    parsed = parse_text(hermes(lenient_json=True), '{"name": "a", "arguments": 3}')
    assert parsed.error is not None and "must be a JSON object" in parsed.error


def test_bare_json_stays_content_unless_lenient_json_is_on():
    text = '{"name": "lookup", "arguments": {"city": "Paris"}}'
    parsed = parse_text(hermes(), text)
    assert parsed.message == {"role": "assistant", "content": text}


def test_tagged_calls_win_over_bare_json_in_lenient_mode():
    text = (
        'e.g. {"name": "z", "arguments": {}}\n'
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_text(hermes(lenient_json=True), text)
    assert parsed.message is not None
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["a"]
    assert parsed.message["content"] == 'e.g. {"name": "z", "arguments": {}}'


# ---- choosing a codec ----


def test_get_codec_knows_hermes_its_qwen25_alias_and_qwen3():
    tokenizer = make_tokenizer(HERMES_CHAT_TEMPLATE)
    assert type(get_codec("hermes", tokenizer)) is HermesCodec
    assert type(get_codec("qwen2.5", tokenizer, lenient_json=True)) is HermesCodec
    codec = get_codec("qwen3", tokenizer, enable_thinking=False)
    assert isinstance(codec, Qwen3Codec) and not codec.enable_thinking
    with pytest.raises(ValueError, match=r"hermes.*qwen2\.5.*qwen3"):
        get_codec("llama", tokenizer)


def test_get_codec_reads_the_default_system_prompt_from_the_template_unless_given():
    qwen25_like = make_tokenizer(QWEN25_LIKE_TEMPLATE)
    assert get_codec("hermes", qwen25_like).default_system == QWEN25_DEFAULT_SYSTEM  # type: ignore[attr-defined]
    assert get_codec("hermes", qwen25_like, default_system=None).default_system is None  # type: ignore[attr-defined]
    assert get_codec("hermes", make_tokenizer(HERMES_CHAT_TEMPLATE)).default_system is None  # type: ignore[attr-defined]
    user = [Message(role="user", content="hi")]
    codec = infer_codec(qwen25_like)
    assert codec.render_prompt(user) == template_ids(codec, user, None, generation_prompt=True)


def test_infer_codec_picks_the_family_from_the_chat_template():
    assert type(infer_codec(make_tokenizer(HERMES_CHAT_TEMPLATE))) is HermesCodec
    assert THINK_OPEN not in HERMES_CHAT_TEMPLATE
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"hermes.*qwen3"):
        infer_codec(make_tokenizer(chatml))


def test_a_tokenizer_without_im_end_as_one_token_is_refused():
    renamed = trained_tokenizer_json(True).replace('"<|im_end|>"', '"<|im_stop|>"')
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(renamed))
    with pytest.raises(ValueError, match="single token"):
        HermesCodec(tokenizer)


HERMES_EDGE_CONVERSATIONS = {
    "a system message that is not first": [
        Message(role="user", content="q"),
        Message(role="system", content="late"),
        Message(role="assistant", content="a"),
    ],
    "an empty system message": [
        Message(role="system", content=""),
        Message(role="user", content="q"),
    ],
    "an assistant turn without content": [
        Message(role="user", content="q"),
        Message(role="assistant", tool_calls=[call("f", "{}")]),  # type: ignore[list-item]
        Message(role="tool", content="r"),
    ],
    "a tool result right at the start": [Message(role="tool", content="r")],
}


@pytest.mark.parametrize(
    "messages", HERMES_EDGE_CONVERSATIONS.values(), ids=HERMES_EDGE_CONVERSATIONS.keys()
)
@pytest.mark.parametrize("tools", [None, [], [{"type": "function", "function": {"name": "f"}}]])
def test_edge_conversations_render_like_the_template(messages, tools):
    for default_system in (None, QWEN25_DEFAULT_SYSTEM):
        codec = hermes(default_system)
        kwargs = {"default_system": default_system}
        ids, _ = codec.render_conversation(messages, tools)
        assert ids == template_ids(codec, messages, tools, generation_prompt=False, **kwargs)
        expected = template_ids(codec, messages, tools, generation_prompt=True, **kwargs)
        assert codec.render_prompt(messages, tools) == expected


def test_without_a_pretokenizer_regex_training_ids_follow_sampling_not_the_joint_tokenization():
    codec = HermesCodec(make_tokenizer(HERMES_CHAT_TEMPLATE, with_regex=False))
    opening = [Message(role="user", content="q")]
    conversation = [*opening, Message(role="assistant", content="the answer is")]
    joint = template_ids(codec, conversation, None, generation_prompt=False)
    assert "assistant\n" not in [codec.tokenizer.decode([token]) for token in joint]
    sampled = tokens_of(codec, "the answer is<|im_end|>")
    ids, mask = codec.render_conversation(conversation)
    assert ids == codec.render_prompt(opening) + sampled + tokens_of(codec, "\n")
    assert ids != joint
    assert mask == [0] * len(codec.render_prompt(opening)) + [1] * len(sampled) + [0]
