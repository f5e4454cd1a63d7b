"""Score a hosted model: any OpenAI-compatible chat endpoint, on the same env, tasks and scoring
as a local model.

``HostedModel`` names the endpoint: base URL, model name, and the environment variable that
holds the API key (the key itself never goes in code, configs or command lines). Episodes are
played by the rollout layer's chat driver (``rollout/chat.py``): the env's messages and tool
specs go out through the API's ``messages`` and ``tools``, the answer's ``tool_calls`` come
back to the env as the codec's would. So a reward, a pass@k, an ending share means what it
means for a local model; token counts do not (a hosted model's tokens are its own), and are
reported under their own names (``eval/endpoint_tokens_per_episode``).

Requests: at most ``max_concurrency`` in flight; each with ``timeout_s``; a timeout, a dropped
connection, 408/409/429 (rate limit) and 5xx are retried ``max_retries`` times with
exponential backoff and jitter (honouring ``Retry-After``); authentication (401/403), quota
(429 ``insufficient_quota``) and any other 4xx stop the evaluation at once with
``HostedEndpointError`` saying what the endpoint answered. A 400 that the prompt is too long
ends that episode as ``CONTEXT_OVERFLOW``.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from post_training_cookbook.codecs.tool_calls import arguments_object
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.openai_api import (
    RETRIED_STATUSES,
    ResponseTooLarge,
    api_key_from_env,
    async_client,
    bounded_body,
    is_retried,
    message_to_api,
)
from post_training_cookbook.rollout.chat import (
    ChatRunner,
    ChatSampler,
    ChatTurn,
    FinishReason,
    play_chat_group,
)
from post_training_cookbook.rollout.types import Group
from post_training_cookbook.types import Message, ToolCall, ToolSpec

if TYPE_CHECKING:
    from post_training_cookbook.evaluation.results import EvalSettings

CONTEXT_CODES = ("context_length_exceeded", "string_above_max_length")


class HostedEndpointError(RuntimeError):
    """The endpoint refused in a way retrying cannot fix (auth, quota, a bad request), or kept
    failing past the retries."""


@dataclass(frozen=True)
class HostedModel:
    """An OpenAI-compatible chat endpoint to evaluate."""

    model: str
    """The model name the endpoint knows (``"gpt-4.1-mini"``)."""
    base_url: str
    """Up to ``/v1``: ``"https://api.openai.com/v1"``, ``"http://127.0.0.1:8000/v1"``."""
    api_key_env: str | None = "OPENAI_API_KEY"
    """The environment variable that holds the API key; None for an endpoint without one."""
    max_concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0
    """The first retry's wait; each further retry doubles it (with jitter), up to 60 s."""
    max_response_bytes: int = 16_000_000
    """A response body longer than this is not read on: a ``HostedEndpointError`` (not
    retried), so a runaway endpoint cannot fill memory."""

    def __post_init__(self) -> None:
        if not self.max_response_bytes >= 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {self.max_response_bytes}")
        if not self.model:
            raise ValueError("HostedModel needs a model name")
        if not re.match(r"https?://", self.base_url):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.max_concurrency < 1 or self.max_retries < 0:
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        if not self.timeout_s > 0 or self.backoff_s < 0:
            raise ValueError("timeout_s must be > 0 and backoff_s >= 0")

    @property
    def name(self) -> str:
        """Short and folder-safe, as in the output folder's name."""
        return "hosted-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", self.model).strip("-") or "model")

    def api_key(self) -> str:
        """The key from ``api_key_env``; ``ValueError`` naming the variable when it is unset."""
        return api_key_from_env(self.api_key_env, self.base_url)


class OpenAIChatSampler:
    """``ChatSampler`` over the ``openai`` client, with the retry and error rules above."""

    def __init__(
        self,
        hosted: HostedModel,
        api_key: str,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self._hosted = hosted
        self._client = async_client(
            hosted.base_url, api_key, timeout_s=hosted.timeout_s, user="hosted evaluation"
        )
        self._slots = asyncio.Semaphore(hosted.max_concurrency)
        self._sleep = sleep
        self.retries = 0
        """Requests retried so far."""

    async def chat(
        self, messages: list[Message], tools: list[ToolSpec], params: SamplingParams
    ) -> ChatTurn:
        request: dict[str, Any] = {
            "model": self._hosted.model,
            "messages": [message_to_api(message) for message in messages],
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_completion_tokens": params.max_tokens,
        }
        if tools:
            request["tools"] = tools
        if params.seed is not None:
            request["seed"] = params.seed
        async with self._slots:
            return await self._with_retries(request)

    async def close(self) -> None:
        await self._client.close()

    async def _with_retries(self, request: dict[str, Any]) -> ChatTurn:
        import openai

        hosted = self._hosted
        for attempt in range(hosted.max_retries + 1):
            try:
                streamed = self._client.chat.completions.with_streaming_response.create(**request)
                async with streamed as raw:
                    body = await bounded_body(raw.iter_bytes(), hosted.max_response_bytes)
                return _turn(openai.types.chat.ChatCompletion.model_validate_json(body))
            except ResponseTooLarge as error:
                raise HostedEndpointError(f"{hosted.base_url}: {error}") from error
            except openai.APIStatusError as error:
                if _is_context_error(error):
                    return ChatTurn(None, "context_overflow")
                if not is_retried(error) or attempt == hosted.max_retries:
                    raise HostedEndpointError(_explain(error, hosted)) from error
                wait = _retry_after(error)
            except (openai.APITimeoutError, openai.APIConnectionError) as error:
                if attempt == hosted.max_retries:
                    raise HostedEndpointError(
                        f"{hosted.base_url}: {error.message} (after {attempt + 1} tries, "
                        f"timeout {hosted.timeout_s:g}s each)"
                    ) from error
                wait = None
            self.retries += 1
            backoff = min(60.0, hosted.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
            await self._sleep(min(60.0, wait) if wait is not None else backoff)
        raise AssertionError("unreachable")


async def play_hosted(
    hosted: HostedModel,
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    settings: EvalSettings,
    on_group: Callable[[], None] = lambda: None,
) -> list[Group]:
    """One group of ``settings.episodes_per_task`` chat episodes per task, on ``hosted``."""
    sampler = OpenAIChatSampler(hosted, hosted.api_key())
    try:
        return await play_chat_tasks(sampler, tasks, env_factory, settings, on_group)
    finally:
        await sampler.close()


async def play_chat_tasks(
    sampler: ChatSampler,
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    settings: EvalSettings,
    on_group: Callable[[], None] = lambda: None,
) -> list[Group]:
    """One group of ``settings.episodes_per_task`` chat episodes per task, on ``sampler``."""
    runner = ChatRunner(env_factory, sampler, settings.limits)
    params = SamplingParams(
        max_tokens=settings.limits.max_tokens_per_turn,
        temperature=settings.temperature,
        top_p=settings.top_p,
    )

    async def play_task(task: Task) -> Group:
        group = await play_chat_group(runner, task, settings.episodes_per_task, params)
        on_group()
        return group

    return list(await asyncio.gather(*(play_task(task) for task in tasks)))


# ---------------------------------------------------------------- answers


def _turn(response: Any) -> ChatTurn:
    """The first choice as a ``ChatTurn``: our message, or ``None`` for tool calls the codecs
    would not parse (arguments that are not a JSON object, non-function tools)."""
    choice = response.choices[0]
    usage = response.usage
    prompt = usage.prompt_tokens if usage is not None else None
    completion = usage.completion_tokens if usage is not None else None
    finish: FinishReason = "length" if choice.finish_reason == "length" else "stop"
    return ChatTurn(_message(choice.message), finish, prompt, completion)


def _message(answer: Any) -> Message | None:
    message = Message(role="assistant", content=answer.content or "")
    calls: list[ToolCall] = []
    for call in answer.tool_calls or []:
        function = getattr(call, "function", None)
        if getattr(call, "type", None) != "function" or function is None:
            return None
        try:
            arguments_object(function.arguments)
        except (ValueError, TypeError, RecursionError):
            return None
        calls.append(
            ToolCall(
                id=call.id,
                type="function",
                function={"name": function.name, "arguments": function.arguments},
            )
        )
    if calls:
        message["tool_calls"] = calls
    reasoning = getattr(answer, "reasoning_content", None)
    if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    return message


def _is_context_error(error: Any) -> bool:
    return error.status_code == 400 and (
        error.code in CONTEXT_CODES or "context length" in str(error.message).lower()
    )


def _retry_after(error: Any) -> float | None:
    value = error.response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _explain(error: Any, hosted: HostedModel) -> str:
    status, where = error.status_code, f"{hosted.base_url} (model {hosted.model!r})"
    said = f"the endpoint said: {error.message}"
    if status in (401, 403):
        key = f"${hosted.api_key_env}" if hosted.api_key_env else "no API key (api_key_env=None)"
        return f"{where} refused the API key from {key} ({status}); {said}"
    if status == 429 and error.code == "insufficient_quota":
        return f"{where}: the account's quota is spent (429 insufficient_quota); {said}"
    if status == 404:
        return f"{where}: not found (404): check the base URL and the model name; {said}"
    if status == 429 or status >= 500 or status in RETRIED_STATUSES:
        return f"{where} kept failing ({status}) after {hosted.max_retries} retries; {said}"
    return f"{where} refused the request ({status}); {said}"
