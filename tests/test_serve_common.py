"""Shared pieces of the policy-server, hosted-evaluation and agent tests: a sampler wrapper
that keeps what the real engine sampled, a gate that holds a sampler, and a scripted HTTP
endpoint for the client's retry rules.

No tests live here; ``test_serve*``, ``test_hosted_eval`` and ``test_agents`` import it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.rollout.types import Sampler


@dataclass
class Sampled:
    prompt: list[int]
    params: SamplingParams
    sequences: list[SampledSequence]


@dataclass
class RecordingSampler:
    """The real sampler, with every prompt it got and what it sampled kept in ``calls``."""

    sampler: Sampler
    calls: list[Sampled] = field(default_factory=list)
    gate: threading.Event | None = None
    """When set, each call waits for it (``entered`` says a call is waiting)."""
    entered: threading.Event = field(default_factory=threading.Event)

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        if self.gate is not None:
            self.entered.set()
            await asyncio.to_thread(self.gate.wait, 30)
        sequences = await self.sampler.sample(prompt_tokens, n, params)
        self.calls.append(Sampled(list(prompt_tokens), params, sequences))
        return sequences


@dataclass
class SplitSampler:
    """Samples with the real sampler, then hands each completion back re-split into one token
    per character (special tokens kept): the same text in tokens the tokenizer would never
    produce, so that anything re-tokenizing a turn from its text shows."""

    sampler: Sampler
    tokenizer: Any

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        sequences = await self.sampler.sample(prompt_tokens, n, params)
        return [self.split(sequence) for sequence in sequences]

    def split(self, sequence: SampledSequence) -> SampledSequence:
        tokens: list[int] = []
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        for token in sequence.tokens:
            pieces = [self.tokenizer.encode(c, add_special_tokens=False) for c in self.text(token)]
            if token in special or not all(len(piece) == 1 for piece in pieces):
                tokens.append(token)
            else:
                tokens += [piece[0] for piece in pieces]
        logprobs = [-1.0] * len(tokens)
        return SampledSequence(tokens, logprobs, sequence.stop_reason, sequence.policy_segments)

    def text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))


def completion_json(content: str | None = "7", tool_calls: list[Any] | None = None) -> dict:
    """A chat completion as the OpenAI API writes one."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13},
    }


@dataclass
class Scripted:
    """One scripted answer: a status and a body, after ``delay_s``."""

    status: int = 200
    body: dict[str, Any] = field(default_factory=completion_json)
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None
    """Sent as the body instead of ``body``: JSON that Python's encoder would refuse to
    write (``NaN``, ``Infinity``), as another server may."""


def error_json(message: str, code: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class ScriptedEndpoint:
    """An HTTP endpoint on 127.0.0.1 answering POSTs to ``path`` (``/v1/chat/completions``)
    with ``script`` in order (the last answer repeats): for the hosted client's retry and
    error rules, and an endpoint teacher's."""

    def __init__(self, script: list[Scripted], path: str = "/v1/chat/completions") -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0

        async def completions(request: Request) -> Response:
            self.requests.append(await request.json())
            answer = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(answer.delay_s)
            finally:
                self.in_flight -= 1
            if answer.raw is not None:
                return Response(answer.raw, answer.status, headers=answer.headers,
                                media_type="application/json")  # fmt: skip
            return JSONResponse(answer.body, answer.status, headers=answer.headers)

        app = Starlette(routes=[Route(path, completions, methods=["POST"])])
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(16)
        self._socket.setblocking(False)
        self.base_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        wait_until(lambda: self._server.started)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)
