"""The server's pieces without HTTP: reading requests, which histories continue a served turn,
how an episode's turns become segments, and stop strings."""

from __future__ import annotations

import json

import pytest

from post_training_cookbook.agents.episode import Turn, segments
from post_training_cookbook.engine.types import PolicySegment, SampledSequence
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.models.loading import load_codec
from post_training_cookbook.serve.conversations import ConversationStore, ServedTurn
from post_training_cookbook.serve.policy import _cut_at_stop
from post_training_cookbook.serve.wire import ApiError, decode_json, parse_chat_request

CODEC = load_codec(resolve_model("post-training-cookbook/tool-use-tiny"))
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "lookup", "arguments": '{"key": "a.b"}'},
}


def request(**fields):
    return parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_a_request_reads_into_our_messages():
    parsed = parse_chat_request(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                },
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            ],
            "tools": [{"type": "function", "function": {"name": "lookup"}}],
            "max_completion_tokens": 7,
            "stop": "\n\n",
            "user": "ignored",
            "parallel_tool_calls": True,
        }
    )
    assert parsed.messages[0] == {"role": "system", "content": "be brief"}
    assert parsed.messages[2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert parsed.messages[3] == {"role": "tool", "content": "4", "tool_call_id": "call_1"}
    assert parsed.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert (parsed.max_tokens, parsed.stop, parsed.n) == (7, ("\n\n",), 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"n": True},
        {"seed": "1"},
        {"top_p": 0},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"logit_bias": {"1": 5}},
        {"top_logprobs": 2},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "code_interpreter"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "tool", "content": "no id"}]},
    ],
)
def test_fields_that_cannot_be_honoured_are_a_400(fields):
    with pytest.raises(ApiError) as raised:
        request(**fields)
    assert raised.value.status == 400


def test_bodies_that_are_not_plain_json_are_a_400():
    for raw in (b'{"n": NaN}', b"[" * 100_000, b"\xff"):
        with pytest.raises(ApiError):
            decode_json(raw)


def test_a_served_turn_is_found_again_as_a_client_echoes_it():
    store = ConversationStore()
    tools = [
        {"type": "function", "function": {"name": "lookup", "description": "", "parameters": {}}}
    ]
    asked = [{"role": "user", "content": "q"}]
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    store.remember(tools, asked, reply, ServedTurn([1, 2, 3], [3], number=0))
    result = {"role": "tool", "content": "4", "tool_call_id": "call_1"}
    respaced = {**CALL, "function": {"name": "lookup", "arguments": '{ "key":"a.b" }'}}
    echoed = {"role": "assistant", "content": None, "tool_calls": [respaced], "refusal": None}
    plan = store.plan(CODEC, [*asked, echoed, result], tools)
    assert plan.parent is not None and plan.parent.number == 0
    assert plan.tokens[:3] == [1, 2, 3]
    assert plan.tokens[3:] == CODEC.render_extension([result], sampled_tokens=[3])


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m[1].update(content="edited"),
        lambda m: m[1]["tool_calls"][0].update(id="call_other"),
        lambda m: m[0].update(content="q, summarised"),
        lambda m: m.insert(0, {"role": "system", "content": "new"}),
    ],
)
def test_a_changed_history_renders_afresh_and_counts_as_broken(change):
    store = ConversationStore()
    asked = [{"role": "user", "content": "q"}]
    reply = {"role": "assistant", "content": "", "tool_calls": [dict(CALL)]}
    store.remember([], asked, reply, ServedTurn([1, 2, 3], [3]))
    messages = json.loads(json.dumps([*asked, reply, {"role": "user", "content": "go on"}]))
    change(messages)
    plan = store.plan(CODEC, messages, [])
    assert plan.parent is None
    assert plan.tokens == CODEC.render_prompt(messages)


def test_the_store_forgets_the_least_recently_used_turns():
    by_tokens = ConversationStore(max_tokens=5)
    for index in range(3):
        turn = ServedTurn([index, index, index], [])
        by_tokens.remember(
            [],
            [{"role": "user", "content": str(index)}],
            {"role": "assistant", "content": "a"},
            turn,
        )
    assert len(by_tokens) == 1
    store = ConversationStore(max_turns=2)
    for index in range(3):
        store.remember(
            [],
            [{"role": "user", "content": str(index)}],
            {"role": "assistant", "content": "a"},
            ServedTurn([index], []),
        )
    assert len(store) == 2


def sequence(*tokens):
    return SampledSequence(list(tokens), [-0.5] * len(tokens), "stop", [PolicySegment(0, 0)])


def test_turns_chain_into_segments_that_break_at_fresh_renders_and_branches():
    turns = [
        Turn(0, [1], sequence(2), None),  # first call
        Turn(1, [1, 2, 3], sequence(4), 0),  # extends 0
        Turn(2, [9], sequence(8), None),  # history rewritten: a new segment
        Turn(3, [1, 2, 3, 4, 5], sequence(6), 1),  # extends 1
        Turn(4, [1, 2, 3, 4, 5], sequence(7), 1),  # extends 1 again: a branch
    ]
    chains = [[turn.number for turn in chain] for chain in segments(turns)]
    assert chains == [[0, 1, 3], [2], [4]]


def test_a_stop_string_keeps_the_sampled_tokens_up_to_the_one_that_completes_it():
    tokens = CODEC.tokenizer.encode("The answer is 42. Done", add_special_tokens=False)
    cut = _cut_at_stop(sequence(*tokens), (". D",), CODEC)
    assert cut is not None
    kept, before = cut
    assert before == "The answer is 42"
    assert kept.tokens == tokens[: len(kept.tokens)]
    text = CODEC.tokenizer.decode(kept.tokens)
    assert text.startswith("The answer is 42. D") or ". D" in text
    assert _cut_at_stop(sequence(*tokens), ("xyz",), CODEC) is None
