"""The policy server under load on loopback (``benchmarks/server_load.py``: eight clients for
five seconds here, 32 for ten minutes there), and what that load found: a completion whose
client disconnected sampled on to its end, holding its slot, for nobody."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.serve import PolicyServer, ServerLimits, load_served_model

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # not a package
from server_load import IDLE_WITHIN_S, MIX, LoadSettings, failures, load

SERVED_LENGTH = 1024


@pytest.fixture(scope="module")
def served():
    model, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=SERVED_LENGTH)
    yield model
    engine.shutdown()


def test_eight_clients_for_five_seconds_get_no_5xx_no_hang_and_4xx_for_oversize_prompts(
    served, caplog
) -> None:
    settings = LoadSettings(
        clients=8, duration_s=5.0, request_timeout_s=30.0, max_model_length=SERVED_LENGTH,
        sample_every_s=0.25,
    )  # fmt: skip
    with caplog.at_level(logging.ERROR), PolicyServer(served) as server:
        result = asyncio.run(load(f"http://127.0.0.1:{server.port}", os.getpid(), settings))
        in_flight = server.routes.in_flight
    kinds = result["kinds"]
    assert all(kinds[kind]["sent"] >= 1 for kind in MIX), kinds  # each client starts on one
    assert result["errors"] == {}, result["errors"]  # no 5xx, hang, dropped or bad stream
    assert kinds["all"]["5xx"] == 0
    assert kinds["oversize"]["4xx"] == kinds["oversize"]["sent"]
    for kind in ("plain", "tools", "tool_result"):
        assert kinds[kind]["whole"] == kinds[kind]["sent"], (kind, kinds[kind])
    # the clients that left (disconnect, cancel, abandon) left no sampling behind
    assert result["server"]["idle_after_abandon_s"] <= IDLE_WITHIN_S
    assert result["server"]["after_load_status"] == 200 and in_flight == 0
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    # the flatness of RSS and threads needs minutes of load: the benchmark's ten-minute run
    assert [f for f in failures(result) if not f.startswith("RSS")] == []


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
