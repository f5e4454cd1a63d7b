"""The OpenAI chat-completions API as the cookbook's clients and server share it: our
``Message`` written as the API writes one, the API key read from the environment, the async
client, a response body read within a size bound, and the one rule for which failures are
worth another try.

Its users: the policy server (``serve/``, the server side), hosted evaluation
(``evaluation/hosted.py``) and judge rewards (``envs/judge.py``), the two client sides. It
sits below all of them and imports neither torch nor (until a client is built) ``openai``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from post_training_cookbook.types import Message

if TYPE_CHECKING:
    import openai

RETRIED_STATUSES = (408, 409, 429)
"""HTTP statuses retried besides 5xx: a request timeout, a conflict, a rate limit."""


def is_retried(error: Any) -> bool:
    """Whether an ``openai.APIStatusError`` may go away on its own: 408, 409, 429 (a rate
    limit, not a spent quota) and 5xx. Authentication, a spent quota and other 4xx do not."""
    if error.status_code == 429 and getattr(error, "code", None) == "insufficient_quota":
        return False
    return bool(error.status_code in RETRIED_STATUSES or error.status_code >= 500)


class ResponseTooLarge(Exception):
    """An endpoint's response was longer than its caller's ``max_response_bytes``."""


async def bounded_body(chunks: Any, max_bytes: int) -> bytes:
    """The bytes of ``chunks`` (an async iterator), or ``ResponseTooLarge`` as soon as they
    pass ``max_bytes``: nothing past the bound is held."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise ResponseTooLarge(f"the response passed max_response_bytes={max_bytes:,}")
    return bytes(body)


def message_to_api(message: Message) -> dict[str, Any]:
    """Our ``Message`` as the API writes one (content ``None`` beside tool calls)."""
    written: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if calls:
        written["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": dict(call["function"])}
            for call in calls
        ]
        written["content"] = message.get("content") or None
    for name in ("tool_call_id", "name", "reasoning_content"):
        if name in message:
            written[name] = message[name]
    return written


def api_key_from_env(api_key_env: str | None, base_url: str) -> str:
    """The key in the environment variable ``api_key_env`` (``"unused"`` when None: an
    endpoint without one); ``ValueError`` naming the variable when it is unset."""
    if api_key_env is None:
        return "unused"
    key = os.environ.get(api_key_env, "")
    if not key:
        raise ValueError(
            f"the environment variable {api_key_env} holds no API key for {base_url}: "
            "export it, or pass api_key_env=None for an endpoint without one"
        )
    return key


def async_client(
    base_url: str, api_key: str, *, timeout_s: float | None = None, user: str = "this"
) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` for ``base_url`` with the client's own retries off (the
    callers retry by ``is_retried``, with their own backoff). ``user`` names the caller in
    the error raised when the ``openai`` extra is missing."""
    try:
        import openai
    except ImportError as exc:
        raise ImportError(f"{user} needs: pip install 'post-training-cookbook[openai]'") from exc
    options: dict[str, Any] = {"base_url": base_url, "api_key": api_key, "max_retries": 0}
    if timeout_s is not None:
        options["timeout"] = timeout_s
    return openai.AsyncOpenAI(**options)
