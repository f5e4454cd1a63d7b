"""``stream: true`` on the policy server: the completion is computed as without it and sent as
the server-sent events a streaming client reads. The real ``openai`` client's streaming API
reads the same answer as the plain one on loopback, an agent that streams plays the same
episode (the same tokens, one unbroken segment) as one that does not, and malformed
``stream`` / ``stream_options`` get a 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from starlette.testclient import TestClient
from test_serve_common import RecordingSampler

from post_training_cookbook.agents import AgentEnvs
from post_training_cookbook.envs.tool_use_game import SYSTEM_PROMPT, TOOL_USE_GAME_VAL_TASKS
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.serve import PolicyServer, load_served_model
from post_training_cookbook.serve.app import Routes, ServerLimits, build_app
from post_training_cookbook.serve.policy import Endpoint
from post_training_cookbook.serve.wire import ApiError, parse_chat_request, stream_chunks

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def served():
    model, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=1024)
    recorder = RecordingSampler(engine)
    yield replace(model, sampler=recorder), recorder
    engine.shutdown()


def fact_tools():
    from post_training_cookbook.envs.tool_use_game import ToolUseGameEnv

    return ToolUseGameEnv().tool_specs


def opening(index=0):
    task = TOOL_USE_GAME_VAL_TASKS[index]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]


def test_the_openai_clients_streaming_api_reads_the_same_answer_as_a_plain_call(served):
    model, recorder = served
    tools = fact_tools()
    with PolicyServer(model) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        for index in range(3):
            ask = {"model": "x", "messages": opening(index), "tools": tools, "temperature": 0}
            plain = client.chat.completions.create(**ask, logprobs=True)
            plain_call = recorder.calls[-1]
            with client.chat.completions.stream(
                **ask, logprobs=True, stream_options={"include_usage": True}
            ) as stream:
                final = stream.get_final_completion()
            streamed_call = recorder.calls[-1]
            assert streamed_call.prompt == plain_call.prompt
            assert streamed_call.sequences[0].tokens == plain_call.sequences[0].tokens
            got, want = final.choices[0], plain.choices[0]
            assert got.finish_reason == want.finish_reason
            assert got.message.content == want.message.content
            assert [
                (c.function.name, c.function.arguments) for c in got.message.tool_calls or []
            ] == [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
            # as sampled (a second greedy pass may differ in the last bits: the prefix cache)
            assert [e.logprob for e in got.logprobs.content] == streamed_call.sequences[0].logprobs
            assert final.usage.model_dump() == plain.usage.model_dump()
            assert final.system_fingerprint == plain.system_fingerprint

        # create(stream=True) without stream_options: chunks, no usage chunk, then the end
        chunks = list(
            client.chat.completions.create(
                model="x", messages=[USER], max_tokens=4, n=2, stream=True
            )
        )
        assert sorted({c.choices[0].index for c in chunks}) == [0, 1]
        assert all(c.usage is None and c.choices for c in chunks)
        assert {c.choices[0].finish_reason for c in chunks[1::2]} <= {"stop", "length"}


def test_stream_chunks_hold_the_whole_message_with_tool_call_indices():
    message = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    body = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "system_fingerprint": "policy-v0",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }  # fmt: skip
    raw = stream_chunks(body, include_usage=True).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    delta = chunks[0]["choices"][0]["delta"]
    assert [call["index"] for call in delta["tool_calls"]] == [0, 1]
    assert delta["tool_calls"][1]["function"] == {"name": "g", "arguments": "{}"}
    assert chunks[1]["choices"][0] == {
        "index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None
    }  # fmt: skip
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["total_tokens"] == 5
    assert chunks[0]["usage"] is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"stream": True, "stream_options": "usage"}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ],
)
def test_malformed_stream_fields_get_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as raised:
        parse_chat_request({"messages": [USER], **fields})
    assert raised.value.status == 400 and raised.value.param == param
    asked = parse_chat_request(
        {"messages": [USER], "stream": True, "stream_options": {"include_usage": None}}
    )
    assert asked.stream and not asked.include_usage


def test_a_streamed_request_is_answered_as_events_and_a_malformed_one_as_json(served):
    model, _ = served
    routes = Routes(Endpoint(model), None, ServerLimits())
    client = TestClient(build_app(routes))
    answer = client.post(
        "/v1/chat/completions",
        json={"messages": [USER], "max_tokens": 2, "stream": True,
              "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text.endswith("data: [DONE]\n\n")
    refused = client.post("/v1/chat/completions", json={"messages": [USER], "stream": "on"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


# ---------------------------------------------------------------- an agent that streams

CLIENT = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0)


def two_turn_agent(stream: bool):
    """Asks, sends its reply back with one more user message, asks again (greedy)."""

    def agent(base_url, api_key, task):
        client = CLIENT.with_options(base_url=base_url, api_key=api_key)
        messages = opening(0)
        for _ in range(2):
            ask = {"model": "policy", "messages": messages, "tools": fact_tools()}
            if stream:
                with client.chat.completions.stream(
                    **ask, max_tokens=32, stream_options={"include_usage": True}
                ) as events:
                    message = events.get_final_completion().choices[0].message
            else:
                message = client.chat.completions.create(**ask, max_tokens=32).choices[0].message
            reply = message.model_dump(exclude_none=True)
            for key in ("parsed", "refusal"):  # the stream helper's extras
                reply.pop(key, None)
            for call in reply.get("tool_calls", []):
                call.get("function", {}).pop("parsed_arguments", None)
            messages = [*messages, reply]
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Again, please."})
        return 1.0

    return agent


def test_an_agent_that_streams_plays_the_same_episode_as_one_that_does_not():
    episodes = {}
    for stream in (False, True):
        with AgentEnvs(two_turn_agent(stream)) as env_factory:
            result = evaluate(
                BUNDLED_MODEL_ID, TOOL_USE_GAME_VAL_TASKS[:1], env_factory, 1, runs_dir=None,
                max_turns=4, max_tokens_per_turn=32, temperature=0.0,
            )  # fmt: skip
        (episode,) = [e for g in result.groups for e in g.episodes]
        episodes[stream] = episode
    plain, streamed = episodes[False], episodes[True]
    assert streamed.num_turns == plain.num_turns == 2
    assert streamed.metrics["agent_history_breaks"] == 0.0  # the streamed reply extended
    assert streamed.segment_starts == plain.segment_starts == [0]
    assert streamed.tokens == plain.tokens
    assert streamed.mask == plain.mask
    assert streamed.num_sampled_tokens > 0
