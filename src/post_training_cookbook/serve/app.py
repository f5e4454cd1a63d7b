"""The HTTP face of the policy server: routes, the bearer token, and the bounds on requests.

Routes (every answer JSON, but a ``stream: true`` completion's, which is server-sent events;
errors in the API's format with their status codes):

    POST /v1/chat/completions                     the served model (``serve``)
    POST /v1/completions                          prompt log-probabilities (``prompt_scores``)
    GET  /v1/models                               its name
    POST /episodes/<id>/v1/chat/completions       one episode of the agent adapter
    GET  /episodes/<id>/v1/models
    GET  /health

Bounds: a body over ``max_request_bytes`` is refused with 413 before it is read whole (by its
Content-Length, else as it streams in); a body slower than ``body_timeout_s`` gets 408, and
headers slower than ``header_timeout_s`` close the connection; decoding, checking and
tokenizing a request run off the event loop, so a large one does not hold the others up;
more than ``max_concurrent_requests`` completions in
flight get 429 ``server_busy`` (the ``openai`` client retries those with backoff); a chat
completion whose client disconnects before it is sampled stops sampling, and its slot frees
once it has (it would otherwise sample on, holding the slot, for nobody). Auth: the
served model's routes need ``Authorization: Bearer <token>`` when the server has a token
(it must have one when bound off loopback, see ``server.py``); an episode's routes need that
episode's own key, so that one agent cannot write into another's episode. The key is checked
before a request takes a slot or its body is read: requests without it cannot hold the slots
authorised ones need (nor does a connection count limit apply, which they could fill).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from post_training_cookbook.serve.policy import ClientGone, Endpoint
from post_training_cookbook.serve.prompt_scores import parse_prompt_score_request, score_prompts
from post_training_cookbook.serve.wire import (
    ApiError,
    ChatRequest,
    decode_json,
    error_body,
    parse_chat_request,
    stream_chunks,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """How much one request, and all of them together, may ask of the server."""

    max_request_bytes: int = 4 * 2**20
    max_concurrent_requests: int = 64
    max_n: int = 16
    """The most choices one request may ask for."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a request's headers this long after it opened (or
    after its previous answer) is closed (``serve/timeouts.py``)."""
    body_timeout_s: float = 30.0
    """A request whose body has not arrived whole this long after its headers gets 408."""

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_concurrent_requests", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Routes:
    """What the app serves; the server adds and removes episodes while it runs."""

    default: Endpoint | None
    token: str | None
    limits: ServerLimits
    episodes: dict[str, tuple[str, Endpoint]] = field(default_factory=dict)
    """Episode id → (its key, its endpoint)."""
    in_flight: int = 0


def build_app(routes: Routes) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _answer(request, routes, lambda: _default(routes, request))

    async def prompt_scores(request: Request) -> Response:
        return await _answer(request, routes, lambda: _default(routes, request), scores=True)

    async def episode_completions(request: Request) -> Response:
        return await _answer(request, routes, lambda: _episode(routes, request))

    async def models(request: Request) -> JSONResponse:
        return _models(lambda: _default(routes, request))

    async def episode_models(request: Request) -> JSONResponse:
        return _models(lambda: _episode(routes, request))

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = exc.detail if isinstance(exc, HTTPException) else "internal server error"
        return JSONResponse(error_body(str(message)), status_code=status)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", prompt_scores, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/episodes/{episode}/v1/chat/completions", episode_completions, methods=["POST"]),
            Route("/episodes/{episode}/v1/models", episode_models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: http_error},
    )


async def _answer(request: Request, routes: Routes, find: Any, *, scores: bool = False) -> Response:
    try:
        endpoint: Endpoint = find()  # the key first: without it, nothing is read or held
        limits = routes.limits
        try:  # the body before a slot: a client sending it slowly holds no slot meanwhile
            async with asyncio.timeout(limits.body_timeout_s):
                raw = await _read_body(request, limits.max_request_bytes)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {limits.body_timeout_s:g}s",
                code="request_timeout",
            ) from None
        if routes.in_flight >= limits.max_concurrent_requests:
            raise ApiError(
                429,
                f"the server has {routes.in_flight} requests in flight (its limit): retry later",
                kind="server_busy",
                code="server_busy",
            )
        routes.in_flight += 1
        try:
            if scores:
                vocab = len(endpoint.model.codec.tokenizer)
                body = await asyncio.to_thread(decode_json, raw)
                asked = await asyncio.to_thread(
                    parse_prompt_score_request, body, vocab, endpoint.model.max_model_length
                )
                return JSONResponse(await score_prompts(endpoint.model, asked))
            # off the event loop: a 4 MB body takes a while to decode and check
            chat = await asyncio.to_thread(_parsed, raw, limits.max_n)
            client_gone = asyncio.ensure_future(_disconnected(request))
            try:
                answer = await endpoint.complete(chat, client_gone)
            finally:
                client_gone.cancel()
            if chat.stream:  # computed whole, sent as the events a streaming client reads
                events = stream_chunks(answer, include_usage=chat.include_usage)
                return Response(events, media_type="text/event-stream")
            return JSONResponse(answer)
        finally:
            routes.in_flight -= 1
    except ApiError as error:
        return JSONResponse(error.body(), status_code=error.status)
    except ClientGone:  # nobody reads this answer: 499, as nginx logs a client that left
        return Response(status_code=499)
    except Exception:
        log.exception("chat completion failed")
        return JSONResponse(error_body("internal server error", kind="server_error"), 500)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (its body is read by then, so the
    next message the server has for this request is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _parsed(raw: bytes, max_n: int) -> ChatRequest:
    return parse_chat_request(decode_json(raw), max_n=max_n)


def _default(routes: Routes, request: Request) -> Endpoint:
    if routes.default is None:
        raise ApiError(404, "this server serves episodes only: use the base URL it gave you")
    if routes.token is not None:
        _check_key(request, routes.token)
    return routes.default


def _episode(routes: Routes, request: Request) -> Endpoint:
    found = routes.episodes.get(request.path_params["episode"])
    if found is None:
        raise ApiError(404, "no such episode (it ended, or never began)", code="episode_not_found")
    key, endpoint = found
    _check_key(request, key)
    return endpoint


def _check_key(request: Request, expected: str) -> None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected.encode()):
        raise ApiError(
            401,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
            code="invalid_api_key",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    def too_large() -> ApiError:
        return ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _models(find: Callable[[], Endpoint]) -> JSONResponse:
    """``/models``: the one model of the endpoint ``find`` gives (its key checked), or the
    error it raises."""
    try:
        endpoint = find()
    except ApiError as error:
        return JSONResponse(error.body(), status_code=error.status)
    model = {"id": endpoint.model.name, "object": "model", "created": 0, "owned_by": "local"}
    return JSONResponse({"object": "list", "data": [model]})
