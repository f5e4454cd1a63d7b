"""The policy server on hostile input: every malformed field a 400 naming it (never a 500);
a fuzz of the request schemas of chat completions and prompt scoring (5,000 generated
requests, each answered 200 or 4xx, the server answering well-formed requests after); slow
clients on loopback (headers or bodies sent slowly, without the token) cannot keep
authorised requests from being served; a large request is decoded and tokenized off the
event loop."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.serve import PolicyServer, ServerLimits, load_served_model
from post_training_cookbook.serve.app import Routes, build_app
from post_training_cookbook.serve.policy import Endpoint
from post_training_cookbook.serve.wire import ApiError, parse_chat_request

USER = {"role": "user", "content": "What is kalo.weight?"}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
LONE = "\ud800"


@pytest.fixture(scope="module")
def served():
    model, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=SERVED_LENGTH)
    yield replace(model, default_max_tokens=2)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    app = build_app(Routes(Endpoint(served), None, ServerLimits()))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


MALFORMED: dict[str, tuple[dict[str, Any], str]] = {
    "surrogate content": ({"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    "surrogate tool name": (
        {"messages": [USER], "tools": [{"type": "function", "function": {"name": LONE}}]},
        "tools[0].function.name",
    ),
    "surrogate stop": ({"messages": [USER], "stop": ["x" + LONE]}, "stop[0]"),
    "surrogate arguments": (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "lookup", "arguments": LONE}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    "surrogate escaped in the arguments' JSON": (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {**CALL, "function": {"name": "lookup", "arguments": '{"a": "\\ud800"}'}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    "tools entry a number": ({"messages": [USER], "tools": [5]}, "tools[0]"),
    "tools entry a string": ({"messages": [USER], "tools": ["lookup"]}, "tools[0]"),
    "role a list": ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0]"),
    "role an object": ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0]"),
    "tiny temperature": (
        {"messages": [USER], "temperature": 1e-40, "logprobs": True},
        "temperature",
    ),
    "tinier temperature": ({"messages": [USER], "temperature": 5e-324}, "temperature"),
    "tiny top_p": ({"messages": [USER], "top_p": 1e-300, "logprobs": True}, "top_p"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_field_is_a_400_naming_it(client, case) -> None:
    body, param = MALFORMED[case]
    with pytest.raises(ApiError) as raised:
        parse_chat_request(body)
    assert raised.value.status == 400 and raised.value.param == param
    answer = client.post("/v1/chat/completions", content=json.dumps(body))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


MALFORMED_SCORES: dict[str, tuple[dict[str, Any], str]] = {
    "prompt past the context": ({"prompt": [5] * 1025, "prompt_logprobs": 0}, "prompt"),
    "one of the prompts past it": (
        {"prompt": [[5, 6], [5] * 20_000], "prompt_logprobs": 0},
        "prompt",
    ),
    "prompt_logprobs a bool": ({"prompt": [5, 6], "prompt_logprobs": True}, "prompt_logprobs"),
    "max_tokens a bool": ({"prompt": [5, 6], "prompt_logprobs": 0, "max_tokens": True},
                          "max_tokens"),
    "max_tokens a float": ({"prompt": [5, 6], "prompt_logprobs": 0, "max_tokens": 1.0},
                           "max_tokens"),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED_SCORES)
def test_a_malformed_prompt_score_request_is_a_400_naming_the_field(client, case) -> None:
    body, param = MALFORMED_SCORES[case]
    started = time.perf_counter()
    answer = client.post("/v1/completions", content=json.dumps(body))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert time.perf_counter() - started < 5.0  # refused, not scored


# ---------------------------------------------------------------- the fuzz

TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
"""Any code point, lone surrogates included."""
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSON
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})) | JSON
FUNCTION = st.fixed_dictionaries(
    {"name": st.sampled_from(["lookup", ""]) | TEXT | JSON},
    optional={"arguments": st.sampled_from(["{}", '{"key": "a"}', "[]", "{"]) | JSON,
              "parameters": st.just({"type": "object"}) | JSON, "description": TEXT | JSON},
)  # fmt: skip
TOOL_CALL = st.fixed_dictionaries(
    {"id": TEXT | JSON, "type": st.just("function") | JSON, "function": FUNCTION | JSON}
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE, "content": CONTENT},
    optional={"tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON,
              "tool_call_id": TEXT | JSON, "name": TEXT | JSON},
)  # fmt: skip
BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                 "function": FUNCTION}) | JSON, max_size=2) | JSON,
        "temperature": st.floats() | JSON, "top_p": st.floats() | JSON,
        "max_tokens": st.integers(-2, 2) | JSON, "max_completion_tokens": st.integers(-2, 2),
        "n": st.integers(-1, 2) | JSON, "stop": TEXT | st.lists(TEXT, max_size=5) | JSON,
        "seed": st.integers(-(2**65), 2**65) | JSON, "logprobs": st.booleans() | JSON,
        "stream": st.booleans() | JSON, "tool_choice": st.just("auto") | JSON, "model": JSON,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()
                                                              | JSON}) | JSON,
    },
)  # fmt: skip


CHAT = "/v1/chat/completions"
SCORES = "/v1/completions"
SERVED_LENGTH = 1024
"""The fixture's served context: prompt scoring refuses longer prompts."""
VALID_IDS = st.lists(st.integers(0, 1535), min_size=1, max_size=6)
"""Token ids of the bundled model (1,536 of them)."""
EDGE_IDS = st.lists(st.integers(-2, 1540) | st.sampled_from([-(2**70), 2**70]), max_size=6)
"""Ids at and past both ends of the vocabulary, and past int64."""
IDS = VALID_IDS | EDGE_IDS | st.lists(st.integers(-2, 1540) | SCALARS, max_size=6)
LONG = st.sampled_from([SERVED_LENGTH, SERVED_LENGTH + 1, 20_000]).map(lambda n: [5] * n)
PROMPT = IDS | st.lists(VALID_IDS, min_size=1, max_size=3) | st.lists(IDS | LONG, max_size=3)
PROMPT = PROMPT | LONG | TEXT | JSON
SCORE_BODY = st.fixed_dictionaries(
    {"prompt": PROMPT, "prompt_logprobs": st.just(0) | st.integers(-1, 2) | JSON},
    optional={"max_tokens": st.integers(-1, 2) | JSON, "model": JSON,
              "temperature": st.floats() | JSON, "echo": st.booleans() | JSON, "n": JSON},
)  # fmt: skip
REQUEST = st.tuples(st.just(CHAT), BODY | JSON) | st.tuples(st.just(SCORES), SCORE_BODY | JSON)
"""(route, body): chat completions, or prompt scores (an endpoint teacher's requests)."""


def encoded(body: Any) -> bytes:
    try:
        return json.dumps(body).encode()  # ensure_ascii: surrogates as \ud800 escapes
    except ValueError:  # a float JSON cannot spell: send it the way Python writes it
        return json.dumps(body, allow_nan=True).encode()


def fuzz(client: TestClient, examples: int) -> None:
    """``examples`` generated requests to chat completions and prompt scores, each answered
    200 or 4xx; then a well-formed one to each is answered 200 and /health still answers."""
    answered: dict[str, list[int]] = {CHAT: [], SCORES: []}

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(request=REQUEST, raw=st.none() | st.binary(max_size=40))
    def one_request(request: tuple[str, Any], raw: bytes | None) -> None:
        route, body = request
        content = raw if raw is not None else encoded(body)
        answer = client.post(route, content=content)
        assert answer.status_code == 200 or 400 <= answer.status_code < 500, (
            route, answer.status_code, content[:300], answer.text[:300],
        )  # fmt: skip
        answered[route].append(answer.status_code)

    one_request()
    assert sum(map(len, answered.values())) >= examples
    for statuses in answered.values():
        assert 200 in statuses and any(400 <= status < 500 for status in statuses)
    well_formed = client.post(CHAT, json={"messages": [USER], "max_tokens": 2})
    assert well_formed.status_code == 200
    scored = client.post(SCORES, json={"prompt": [5, 6, 7], "prompt_logprobs": 0})
    assert scored.status_code == 200
    assert list(scored.json()["choices"][0]["prompt_logprobs"][2]) == ["7"]
    assert client.get("/health").json() == {"status": "ok"}


def test_a_short_fuzz_of_the_request_schema_is_answered_200_or_4xx(client) -> None:
    fuzz(client, 300)


@pytest.mark.heavy  # about 70 s on 2 busy cores
def test_a_fuzz_of_5000_requests_is_answered_200_or_4xx_and_the_server_still_serves(
    client,
) -> None:
    fuzz(client, 5000)


# ---------------------------------------------------------------- slow clients on loopback

TOKEN = "t" * 32


def slow_headers(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing
    return sock


def slow_body(port: int, token: str | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}"
        'Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"messages": ['
    )
    sock.sendall(head.encode())
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bytes | None:
    """What the server sent before closing ``sock``, None when it stayed open."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


def test_slow_clients_without_the_token_cannot_starve_authorised_requests(served) -> None:
    limits = ServerLimits(max_concurrent_requests=8, header_timeout_s=1.0, body_timeout_s=1.0)
    with PolicyServer(served, token=TOKEN, limits=limits) as server:
        sockets = [slow_headers(server.port) for _ in range(60)]
        sockets += [slow_body(server.port, None) for _ in range(20)]
        sockets += [slow_body(server.port, TOKEN) for _ in range(10)]  # hold slots, then 408
        client = openai.OpenAI(base_url=server.base_url, api_key=TOKEN, max_retries=0)
        for _ in range(3):  # while all of them are open
            reply = client.chat.completions.create(model="m", messages=[USER], max_tokens=2)
            assert reply.choices[0].message is not None
        answers = [closed_by_server(sock, within_s=10.0) for sock in sockets]
        for sock in sockets:
            sock.close()
        assert all(answer is not None for answer in answers), "a slow connection stayed open"
        assert all(b" 401 " in answer for answer in answers[60:80])  # refused before its body
        assert all(b" 408 " in answer for answer in answers[80:])
        reply = client.chat.completions.create(model="m", messages=[USER], max_tokens=2)
        assert reply.choices[0].message is not None


@pytest.mark.heavy  # tokenizing three 3.5 MB prompts takes half a minute on 2 busy cores
def test_a_large_request_is_tokenized_off_the_event_loop(served) -> None:
    with PolicyServer(served) as server:
        order: list[str] = []
        big = json.dumps({"messages": [{"role": "user", "content": "kalo " * 700_000}]})

        def post_big() -> None:
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                request = (
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(big)}\r\n\r\n"
                )
                sock.sendall(request.encode() + big.encode())
                sock.settimeout(120)
                assert b" 400 " in sock.recv(4096)  # past the context
            order.append("big")

        threads = [threading.Thread(target=post_big) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # the big bodies are in and being tokenized
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            sock.settimeout(120)
            assert b" 200 " in sock.recv(4096)
        order.append("health")
        for thread in threads:
            thread.join(timeout=120)
        assert order[0] == "health", order
