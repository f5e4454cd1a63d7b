"""τ²'s user simulator, its model behind any OpenAI-compatible endpoint.

The simulated user is τ²'s ``UserSimulator``: its system prompt (τ²'s simulation guidelines
and the task's scenario), its state, the roles flipped as τ² flips them and the messages
written as τ² writes them (``to_litellm_messages``), its tools (telecom's phone), its stop
tokens. One part is ours: the request. τ² sends it through litellm's blocking
``completion``, which an event loop can only run in a thread, and a thread stuck on a server
that never answers (or answers a byte a minute) cannot be stopped. Here it is an async
request that is cancelled at its deadline, read up to a size bound, and checked, so a
simulator that fails ends the episode with a named cause (``Tau2UserError.cause``) and
leaves no thread or connection behind.

``UserSimulatorSettings`` is the setting: the model, the endpoint, its sampling settings,
timeout, attempts and size bound. ``Tau2Env`` builds an ``EndpointUser`` from it per episode.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from post_training_cookbook.openai_api import (
    ResponseTooLarge,
    api_key_from_env,
    bounded_body,
    is_retried,
)

if TYPE_CHECKING:
    import openai

CAUSES = ("timeout", "unreachable", "http_status", "too_large", "not_json", "malformed", "empty")
"""Why a simulator's turn failed: no answer within ``timeout_s``; no connection (or it
dropped); an HTTP error status; a body past ``max_response_bytes``; a body that is not JSON;
JSON that is not a chat completion with one message (or tool-call arguments that are not a
JSON object); a message with neither text nor tool calls."""


class Tau2UserError(RuntimeError):
    """The user simulator gave no usable turn: ``cause`` (one of ``CAUSES``) says why. It
    leaves the env's ``reset`` or ``step``, so the rollout makes it an env error under
    ``env_errors`` (the run stops, or the episode is truncated or played again), never a
    reward of τ²'s: its end is not the agent's doing."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"τ² user simulator: {cause}: {detail}")
        self.cause = cause


class _Failure(Exception):
    def __init__(self, cause: str, detail: str, retried: bool = True) -> None:
        super().__init__(detail)
        self.cause, self.retried = cause, retried


@dataclass(frozen=True)
class UserSimulatorSettings:
    """The user simulator's model: an OpenAI-compatible chat endpoint (a hosted API, vLLM,
    or ``post-training-cookbook serve`` with a local model), checked when built."""

    model: str
    """The model name the endpoint serves (``gpt-4.1``; ``serve``'s served name)."""
    base_url: str | None = None
    """The endpoint's ``/v1`` URL; default ``$OPENAI_BASE_URL``, else OpenAI's."""
    api_key_env: str | None = "OPENAI_API_KEY"
    """The environment variable holding the key (checked when built, read when a client is
    made); None: an endpoint without one."""
    temperature: float = 0.0
    """Sampling temperature (τ²'s default for its user, 0.0)."""
    top_p: float | None = None
    max_tokens: int | None = None
    """The reply's token limit, sent as ``max_completion_tokens``; None: the endpoint's."""
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    """More request fields, sent as they are."""
    timeout_s: float = 15.0
    """One attempt's limit, the whole answer included (connection, waiting, reading). With
    the other defaults a user turn takes at most 48 s, within the run's default
    ``env_step_timeout_s`` (60 s): raise that with these."""
    max_attempts: int = 3
    """Attempts per turn: after a timeout, a dropped connection, 408/409/429/5xx, and a reply
    that is not JSON, not a chat completion, or empty. A body past ``max_response_bytes`` and
    other 4xx are not retried."""
    backoff_s: float = 1.0
    """The wait before the second attempt, doubling after each."""
    max_response_bytes: int = 1_000_000
    """A longer body is not read on: the turn fails (``too_large``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        base_url = self.base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        object.__setattr__(self, "base_url", base_url)
        _check_number("temperature", self.temperature, low=0.0)
        if self.top_p is not None:
            _check_number("top_p", self.top_p, low=0.0, high=1.0)
        for name in ("max_tokens", "max_attempts", "max_response_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.extra_body, dict):
            raise ValueError(f"extra_body must be a dict, got {type(self.extra_body).__name__}")
        _check_number("timeout_s", self.timeout_s, low=0.0, strict=True)
        _check_number("backoff_s", self.backoff_s, low=0.0)
        self.api_key()  # an unset key variable fails here, before any episode

    def api_key(self) -> str:
        """The key, read from ``api_key_env`` now (not kept: the settings may be logged)."""
        return api_key_from_env(self.api_key_env, str(self.base_url))

    @property
    def name(self) -> str:
        return f"{self.base_url}#{self.model}"


def _check_number(
    name: str, value: object, *, low: float, high: float = math.inf, strict: bool = False
) -> None:
    """``ValueError`` unless ``value`` is a finite number in [low, high] (``strict``: > low)."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if (
        number is None
        or not math.isfinite(number)
        or number > high
        or number < low
        or (strict and number == low)
    ):
        low_side = f"> {low:g}" if strict else f">= {low:g}"
        high_side = f" and <= {high:g}" if math.isfinite(high) else ""
        raise ValueError(f"{name} must be a finite number {low_side}{high_side}, got {value!r}")


class UserFactory(Protocol):
    """What ``Tau2Env(user=...)`` takes besides ``UserSimulatorSettings``: something that
    builds each episode's user, a τ² ``UserSimulator`` whose turns are prepared ahead
    (``roles.PreparedUser``)."""

    def user_for(self, task: Any, tools: list[Any] | None) -> Any:
        """The user of one episode of ``task`` (a τ² task record), with the domain's user
        tools (None where the domain has none)."""
        ...


Tau2User = UserSimulatorSettings | UserFactory
"""What ``Tau2Env(user=...)`` takes: the user simulator's settings, or any ``UserFactory``."""


def chat_request(
    settings: UserSimulatorSettings, written: list[dict[str, Any]], tools: list[Any] | None
) -> dict[str, Any]:
    """The chat request, τ²'s messages put in the API's shape (no ``tool_calls: null``,
    tool calls as ``{id, type, function}``)."""
    api_messages = []
    for message in written:
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"id": call["id"], "type": "function", "function": call["function"]}
                for call in message["tool_calls"]
            ]
        api_messages.append(message)
    request: dict[str, Any] = {
        "model": settings.model,
        "messages": api_messages,
        "temperature": settings.temperature,
    }
    if tools:
        request["tools"] = [tool.openai_schema for tool in tools]
        request["tool_choice"] = "auto"  # as τ²'s generate asks when there are tools
    for name, value in (("top_p", settings.top_p), ("seed", settings.seed)):
        if value is not None:
            request[name] = value
    if settings.max_tokens is not None:
        request["max_completion_tokens"] = settings.max_tokens
    return request


Reply = tuple[str | None, list[tuple[str, str, dict[str, Any]]]]


async def ask(
    client: openai.AsyncOpenAI, settings: UserSimulatorSettings, request: dict[str, Any]
) -> Reply:
    """The endpoint's reply (its text, its tool calls), after up to ``max_attempts``."""
    problems: list[str] = []
    for attempt in range(settings.max_attempts):
        if attempt:
            await asyncio.sleep(settings.backoff_s * 2 ** (attempt - 1))
        try:
            async with asyncio.timeout(settings.timeout_s):
                body = await _post(client, settings, request)
            return _parse(body)
        except TimeoutError:
            failure = _Failure("timeout", f"no complete answer within {settings.timeout_s:g}s")
        except _Failure as exc:
            failure = exc
        problems.append(f"{failure.cause}: {failure}")
        if not failure.retried or attempt + 1 == settings.max_attempts:
            raise Tau2UserError(
                failure.cause,
                f"{settings.name}: no usable turn after {attempt + 1} attempt(s): "
                + "; ".join(problems),
            )
    raise AssertionError("unreachable: max_attempts >= 1")


async def _post(
    client: openai.AsyncOpenAI, settings: UserSimulatorSettings, request: dict[str, Any]
) -> bytes:
    import openai

    try:
        streamed = client.chat.completions.with_streaming_response.create(
            **request, extra_body=dict(settings.extra_body) or None
        )
        async with streamed as raw:
            return await bounded_body(raw.iter_bytes(), settings.max_response_bytes)
    except ResponseTooLarge as exc:
        raise _Failure("too_large", str(exc), retried=False) from exc
    except openai.APIStatusError as exc:
        said = exc.body.get("message") if isinstance(exc.body, dict) else None
        detail = f"HTTP {exc.status_code}: {str(said or exc)[:300]}"
        raise _Failure("http_status", detail, retried=is_retried(exc)) from exc
    except (openai.APITimeoutError, openai.APIConnectionError) as exc:
        cause = "timeout" if isinstance(exc, openai.APITimeoutError) else "unreachable"
        raise _Failure(cause, str(exc.__cause__ or exc)[:300]) from exc


def _parse(body: bytes) -> Reply:
    """The first choice's text and tool calls; ``_Failure`` naming what is wrong."""
    try:
        completion = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _Failure("not_json", f"the body is not JSON: {body[:120]!r}") from exc
    try:
        message = completion["choices"][0]["message"]
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError(f"content is a {type(content).__name__}")
        calls = []
        for call in message.get("tool_calls") or []:
            function = call["function"]
            arguments = json.loads(function["arguments"] or "{}")
            if not isinstance(arguments, dict) or not isinstance(function["name"], str):
                raise TypeError("a tool call's arguments are not a JSON object")
            call_id = call.get("id") or f"call_{uuid.uuid4().hex[:16]}"  # some servers send none
            calls.append((str(call_id), function["name"], arguments))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RecursionError) as exc:
        raise _Failure("malformed", f"not a chat completion with a message: {exc}") from exc
    if not calls and not (content or "").strip():
        raise _Failure("empty", "the reply has neither text nor tool calls")
    return content if content is not None else None, calls
