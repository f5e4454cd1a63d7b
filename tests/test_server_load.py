"""What the load test of the policy server found: a completion whose client disconnected
sampled on to its end, holding its slot, for nobody."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import replace

import pytest

from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.serve import PolicyServer, ServerLimits, load_served_model

SERVED_LENGTH = 1024


@pytest.fixture(scope="module")
def served():
    model, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=SERVED_LENGTH)
    yield model
    engine.shutdown()


class SamplesUntilCancelled:
    """Its first call samples nothing until cancelled (a completion of minutes); the later
    ones are the engine's."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls = 0
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def sample(self, tokens, n, params):
        self.calls += 1
        if self.calls > 1:
            return await self.engine.sample(tokens, n, params)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


def post(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


def test_a_completion_whose_client_disconnects_stops_sampling_and_frees_its_slot(served) -> None:
    sampler = SamplesUntilCancelled(served.sampler)
    limits = ServerLimits(max_concurrent_requests=1)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with PolicyServer(replace(served, sampler=sampler), limits=limits) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(post(body))
            assert sampler.started.wait(30)
        assert sampler.cancelled.wait(10), "the completion sampled on after its client left"
        deadline = time.monotonic() + 10
        while server.routes.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.routes.in_flight == 0
        with socket.create_connection(("127.0.0.1", server.port)) as sock:  # the one slot
            sock.sendall(post({**body, "stream": False}))
            sock.settimeout(30)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
