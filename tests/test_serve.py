"""The policy server, spoken to by the real ``openai`` client on loopback: tool calls round trip,
the client's own types parse every answer, conversations continue token-in-token-out, and the
bounds hold (the bearer token off loopback, oversized bodies, requests in flight)."""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import replace

import openai
import pytest
from openai.types.chat import ChatCompletion
from test_serve_common import RecordingSampler, SplitSampler, wait_until

from post_training_cookbook.cli import main
from post_training_cookbook.envs.tool_use_game import (
    SYSTEM_PROMPT,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.serve import PolicyServer, ServerLimits, load_served_model

TOOLS = ToolUseGameEnv().tool_specs


@pytest.fixture(scope="module")
def served():
    """The bundled model behind a recording sampler (the real engine underneath)."""
    model, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=1024)
    recorder = RecordingSampler(engine)
    yield replace(model, sampler=recorder), recorder
    engine.shutdown()


@pytest.fixture(scope="module")
def engine_model(served):
    """The bundled model and its bare engine."""
    model, recorder = served
    return model, recorder.sampler


@pytest.fixture(scope="module")
def server(served):
    model, _ = served
    with PolicyServer(model) as running:
        yield running


def client_for(base_url, api_key="unused"):
    # strict validation: an answer that does not fit the client's own types raises
    return openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, _strict_response_validation=True
    )


def opening(index=0):
    task = TOOL_USE_GAME_VAL_TASKS[index]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]


def test_a_tool_call_round_trips_and_the_next_turn_extends_the_sampled_tokens(engine_model):
    model, engine = engine_model
    splitter = SplitSampler(engine, model.codec.tokenizer)
    recorder = RecordingSampler(splitter)
    with PolicyServer(replace(model, sampler=recorder)) as server:
        client = client_for(server.base_url)
        first, second = _two_turns(client)
    sampled = recorder.calls[0]
    tokens = sampled.sequences[0].tokens
    text = model.codec.tokenizer.decode(tokens, skip_special_tokens=False)
    assert model.codec.tokenizer.encode(text, add_special_tokens=False) != tokens  # split
    call = first.choices[0].message.tool_calls[0]
    assert first.usage.prompt_tokens == len(sampled.prompt)
    assert first.usage.completion_tokens == len(tokens)
    tool = {"role": "tool", "content": "42", "tool_call_id": call.id}
    extension = model.codec.render_extension([tool], sampled_tokens=tokens)
    assert recorder.calls[1].prompt == sampled.prompt + tokens + extension
    assert isinstance(second, ChatCompletion)


def test_the_client_parses_a_tool_call_of_the_real_engine(server, served):
    _, recorder = served
    first, _ = _two_turns(client_for(server.base_url))
    sampled = recorder.calls[-2]
    assert first.usage.completion_tokens == len(sampled.sequences[0].tokens)
    assert first.system_fingerprint == "policy-v0"


def _two_turns(client):
    """A tool call at temperature 0 (the bundled model calls a tool first), its result, and
    the next answer."""
    messages = opening()
    first = client.chat.completions.create(
        model="anything", messages=messages, tools=TOOLS, temperature=0
    )
    assert isinstance(first, ChatCompletion)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"list_fact_keys", "lookup", "calculator"}
    assert isinstance(json.loads(call.function.arguments), dict)
    tool_message = {"role": "tool", "tool_call_id": call.id, "content": "42"}
    messages += [choice.message.model_dump(exclude_none=True), tool_message]
    second = client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    assert isinstance(second, ChatCompletion)
    return first, second


def test_the_raw_answer_is_the_apis_format(server):
    raw = client_for(server.base_url).chat.completions.with_raw_response.create(
        model="x", messages=opening(1), tools=TOOLS, temperature=0
    )
    body = raw.http_response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    message = choice["message"]
    if choice["finish_reason"] == "tool_calls":
        assert message["content"] is None
        assert all(isinstance(c["function"]["arguments"], str) for c in message["tool_calls"])
    assert set(body["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_a_rewritten_history_is_rendered_afresh(server, served):
    model, recorder = served
    client = client_for(server.base_url)
    messages = opening(2)
    first = client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    edited = first.choices[0].message.model_dump(exclude_none=True)
    edited["content"] = "I changed my mind."
    edited.pop("tool_calls", None)
    messages += [edited, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    ours = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert recorder.calls[-1].prompt == model.codec.render_prompt(ours, TOOLS)


def test_n_logprobs_max_tokens_and_stop(server, served):
    model, recorder = served
    client = client_for(server.base_url)
    answer = client.chat.completions.create(
        model="x", messages=opening(3), n=2, logprobs=True, max_tokens=3, top_p=0.9, seed=5
    )
    assert [c.index for c in answer.choices] == [0, 1]
    sequences = recorder.calls[-1].sequences
    assert recorder.calls[-1].params.max_tokens == 3
    for choice, sequence in zip(answer.choices, sequences, strict=True):
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(sequence.logprobs)
        if sequence.stop_reason == "length":
            assert choice.finish_reason in ("length", "tool_calls")
    assert answer.usage.completion_tokens == sum(len(s.tokens) for s in sequences)

    # a stop string ends the reply before it; the sampled tokens up to it are kept
    stopped = client.chat.completions.create(
        model="x", messages=opening(4), tools=TOOLS, temperature=0, stop=['"arguments"']
    )
    sampled = recorder.calls[-1].sequences[0].tokens
    assert '"arguments"' in model.codec.tokenizer.decode(sampled)  # the stop string was hit
    assert stopped.choices[0].finish_reason == "stop"
    assert '"arguments"' not in (stopped.choices[0].message.content or "")
    assert stopped.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("arguments", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": 3.0}, "temperature"),
        ({"n": 99}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_requests_the_server_cannot_honour_get_400_naming_the_field(server, arguments, param):
    request = {"model": "x", "messages": opening(), **arguments}
    with pytest.raises(openai.BadRequestError) as raised:
        client_for(server.base_url).chat.completions.create(**request)
    assert raised.value.status_code == 400
    assert raised.value.param == param


def test_oversized_requests_and_prompts_past_the_context_are_refused(served):
    model, recorder = served
    limits = ServerLimits(max_request_bytes=64 * 1024)
    with PolicyServer(model, limits=limits) as small:
        client = client_for(small.base_url)
        calls_before = len(recorder.calls)
        huge = [{"role": "user", "content": "x" * 70_000}]
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="x", messages=huge)
        assert raised.value.status_code == 413 and raised.value.code == "request_too_large"
        long = [{"role": "user", "content": "kalo " * 2000}]  # within the body limit
        with pytest.raises(openai.BadRequestError) as too_long:
            client.chat.completions.create(model="x", messages=long)
        assert too_long.value.code == "context_length_exceeded"
        assert len(recorder.calls) == calls_before  # neither was sampled


def test_requests_past_the_concurrency_limit_get_429(served):
    model, recorder = served
    gate = threading.Event()
    gated = replace(model, sampler=RecordingSampler(recorder, gate=gate))
    with PolicyServer(gated, limits=ServerLimits(max_concurrent_requests=1)) as one:
        client = client_for(one.base_url)
        first = threading.Thread(
            target=client.chat.completions.create,
            kwargs={"model": "x", "messages": opening(), "max_tokens": 2},
        )
        first.start()
        wait_until(gated.sampler.entered.is_set)
        with pytest.raises(openai.RateLimitError) as raised:
            client.chat.completions.create(model="x", messages=opening(), max_tokens=2)
        assert raised.value.code == "server_busy"
        gate.set()
        first.join(timeout=30)
    assert len(gated.sampler.calls) == 1


def test_off_loopback_the_server_needs_a_bearer_token(served):
    model, _ = served
    with pytest.raises(ValueError, match="bearer token"):
        PolicyServer(model, host="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16"):
        PolicyServer(model, host="0.0.0.0", token="short")
    token = secrets.token_urlsafe(24)
    with PolicyServer(model, host="0.0.0.0", token=token) as exposed:
        local_url = f"http://127.0.0.1:{exposed.port}/v1"  # we talk to it on loopback only
        for wrong in ("unused", token[:-1] + "x"):
            with pytest.raises(openai.AuthenticationError):
                client_for(local_url, wrong).chat.completions.create(
                    model="x", messages=opening(), max_tokens=2
                )
            with pytest.raises(openai.AuthenticationError):
                client_for(local_url, wrong).models.list()
        answer = client_for(local_url, token).chat.completions.create(
            model="x", messages=opening(), max_tokens=2
        )
        assert answer.choices
        assert [m.id for m in client_for(local_url, token).models.list()] == [model.name]


def test_an_episode_route_answers_only_its_own_key_and_only_while_open(server, served):
    from post_training_cookbook.serve import Endpoint

    model, _ = served
    route = server.open_episode(Endpoint(model))
    with pytest.raises(openai.AuthenticationError):
        client_for(route.base_url, "someone-else").chat.completions.create(
            model="x", messages=opening(), max_tokens=2
        )
    assert (
        client_for(route.base_url, route.api_key)
        .chat.completions.create(model="x", messages=opening(), max_tokens=2)
        .choices
    )
    server.close_episode(route.episode_id)
    with pytest.raises(openai.NotFoundError):
        client_for(route.base_url, route.api_key).chat.completions.create(
            model="x", messages=opening(), max_tokens=2
        )
    with PolicyServer(None) as bare, pytest.raises(openai.NotFoundError):
        # an episode-only server has no model route
        client_for(bare.base_url).chat.completions.create(model="x", messages=opening())


def test_the_serve_command_refuses_an_exposed_address_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    assert main(["serve", BUNDLED_MODEL_ID, "--host", "0.0.0.0"]) == 2
    assert "bearer token" in capsys.readouterr().err
    assert main(["serve", BUNDLED_MODEL_ID, "--token-env", "NO_SUCH_TOKEN"]) == 2
    assert "NO_SUCH_TOKEN" in capsys.readouterr().err


def test_the_serve_command_serves_until_interrupted(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:  # a free port (the race with another binder is harmless)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "post_training_cookbook", "serve", BUNDLED_MODEL_ID,
               "--port", str(port), "--max-model-length", "512"]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    server = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        client = client_for(f"http://127.0.0.1:{port}/v1")
        deadline = time.monotonic() + 120
        while True:
            try:
                answer = client.chat.completions.create(model="x", messages=opening(), max_tokens=4)
                break
            except openai.APIConnectionError:
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        assert answer.model == "tool-use-tiny" and answer.choices
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
        assert f"serving tool-use-tiny at http://127.0.0.1:{port}/v1" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()


def test_a_runs_checkpoint_and_final_model_are_served():
    from test_eval_common import trained_run

    from post_training_cookbook.serve import start_server

    run = trained_run()  # shared with the evaluation tests: trained once per session
    for options, name in (({"step": 1}, f"{run.name}-step1"), ({}, run.name)):
        with start_server(run, max_model_length=256, **options) as server:
            answer = client_for(server.base_url).chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Say something."}], max_tokens=4
            )
        assert answer.model == name and answer.usage.completion_tokens >= 1
