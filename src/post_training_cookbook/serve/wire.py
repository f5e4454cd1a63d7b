"""The OpenAI chat-completions wire format: requests checked into our records, our records
written back as the API writes them, and errors in the API's error shape.

Pure data, no HTTP and no model: the server (``app.py``) speaks through here; what the
server and the cookbook's clients share (``message_to_api``) is in ``openai_api.py``. A
request is only ever read as JSON and checked field by field; nothing in it is evaluated.
Fields that would change sampling in a way the server cannot honour (penalties, logit bias,
structured output, forced tool choice, top logprobs) are refused with a 400 that names them;
``stream: true`` is answered as server-sent events (``stream_chunks``): the completion is
computed whole, then written as the chunks a streaming client reads; fields that do not
change what is sampled (``user``, ``metadata``, ``store``, ``parallel_tool_calls``...) are
ignored. The module passes 400 lines because it is the one place a request's fields are
read: half of it is the small checks, each refusing one malformed field by name.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from post_training_cookbook.codecs.tool_calls import arguments_object
from post_training_cookbook.engine.types import MIN_TOP_P, temperature_problem
from post_training_cookbook.openai_api import message_to_api
from post_training_cookbook.types import Message, ToolCall, ToolSpec

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP_STRINGS = 4


class ApiError(Exception):
    """An answer in the API's error format: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` request."""

    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    model: str = ""
    n: int = 1
    max_tokens: int | None = None
    """``max_completion_tokens`` or ``max_tokens``; None: the server's default."""
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    """Answer as server-sent events (``stream_chunks``) rather than one JSON body."""
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk carries ``usage``."""


def parse_chat_request(body: Any, *, max_n: int = 16) -> ChatRequest:
    """``body`` (decoded JSON) as a ``ChatRequest``, or ``ApiError(400)`` naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_lone_surrogates(body, "")
    _refuse_unsupported(body)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    messages = [message_from_api(value, f"messages[{i}]") for i, value in enumerate(raw_messages)]
    raw_tools = body.get("tools") or []
    if not isinstance(raw_tools, list):
        raise ApiError(400, "tools must be a list", param="tools")
    tools = [_tool_spec(value, f"tools[{i}]") for i, value in enumerate(raw_tools)]
    max_tokens_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(max_tokens_name)
    seed = body.get("seed")
    stream, include_usage = _stream(body)
    return ChatRequest(
        messages=messages,
        tools=tools,
        model=_optional(body, "model", str) or "",
        n=_integer(_given(body, "n", 1), "n", low=1, high=max_n),
        max_tokens=None if max_tokens is None else _integer(max_tokens, max_tokens_name, low=1),
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 1.0, low=MIN_TOP_P, high=1.0),
        stop=_stop(body.get("stop")),
        seed=None if seed is None else _integer(seed, "seed", low=-(2**63), high=2**64 - 1),
        logprobs=bool(_optional(body, "logprobs", bool)),
        stream=stream,
        include_usage=include_usage,
    )


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``; ``stream_options`` only with
    ``stream: true``, as the API has it."""
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict)
    if options is None:
        return stream, False
    if not stream:
        raise ApiError(
            400, "stream_options is only allowed with stream: true", param="stream_options"
        )
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError(
            400, "stream_options.include_usage must be a boolean", param="stream_options"
        )
    return stream, bool(include_usage)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (sampling is the policy's)", param=name)
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError(
            400, "top_logprobs is not supported (logprobs=true is)", param="top_logprobs"
        )
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(
            400, "only response_format {'type': 'text'} is supported", param="response_format"
        )
    if body.get("tool_choice") not in (None, "auto"):
        raise ApiError(
            400,
            "only tool_choice 'auto' is supported: the model decides whether to call a tool",
            param="tool_choice",
        )
    if body.get("functions") or body.get("function_call"):
        raise ApiError(400, "functions/function_call are deprecated: use tools", param="functions")


def message_from_api(value: Any, where: str) -> Message:
    """One request message as our ``Message``: ``developer`` reads as ``system``, text parts
    are joined, a tool call's arguments must be a JSON object."""
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    role = value.get("role")
    if not isinstance(role, str):
        raise ApiError(
            400, f"{where}.role must be a string, got {type(role).__name__}", param=where
        )
    if role == "tool":
        call_id = value.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ApiError(400, f"{where}: a tool message needs tool_call_id", param=where)
        message = Message(role="tool", content=_text(value.get("content"), where))
        message["tool_call_id"] = call_id
        if isinstance(value.get("name"), str):
            message["name"] = value["name"]
        return message
    if role not in ROLES:
        raise ApiError(400, f"{where}: unknown role {role!r}", param=where)
    message = Message(role=ROLES[role], content=_text(value.get("content"), where))
    if role == "assistant":
        calls = value.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ApiError(400, f"{where}.tool_calls must be a list", param=where)
        if calls:
            message["tool_calls"] = [
                _tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)
            ]
        if isinstance(value.get("reasoning_content"), str):
            message["reasoning_content"] = value["reasoning_content"]
    return message


def completion_body(
    *,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def choice_body(
    index: int, message: Message, finish_reason: str, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    written = message_to_api(message)
    written.setdefault("refusal", None)
    return {
        "index": index,
        "message": written,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
    }


def stream_chunks(body: dict[str, Any], *, include_usage: bool) -> bytes:
    """A whole ``chat.completion`` (``completion_body``) as the server-sent events of a
    streamed one: per choice, a chunk whose delta is the whole message (tool calls with
    their ``index``) and a chunk with its ``finish_reason``; then, with ``include_usage``, a
    chunk with no choices and the usage; then ``data: [DONE]``."""
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
        "system_fingerprint": body["system_fingerprint"],
    }
    usage: dict[str, Any] = {"usage": None} if include_usage else {}
    chunks: list[dict[str, Any]] = []
    for choice in body["choices"]:
        delta = {k: v for k, v in choice["message"].items() if k != "tool_calls"}
        if choice["message"].get("tool_calls"):
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(choice["message"]["tool_calls"])
            ]
        first = {"index": choice["index"], "delta": delta, "finish_reason": None}
        first["logprobs"] = choice["logprobs"]
        last = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        last["logprobs"] = None
        chunks += [{**head, "choices": [first], **usage}, {**head, "choices": [last], **usage}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    events = [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


def decode_json(raw: bytes) -> Any:
    """The request body as JSON (no NaN or Infinity, bounded nesting), or ``ApiError(400)``."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(raw, parse_constant=refuse)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise ApiError(400, f"the request body is not valid JSON: {reason}") from None


# ---------------------------------------------------------------- fields


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    400,
                    f"{where}: only text content parts are supported, got {kind!r}",
                    param=where,
                )
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: a text part needs a string text", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=where)


def _tool_call(value: Any, where: str) -> ToolCall:
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict) or not isinstance(value.get("id"), str):
        raise ApiError(400, f"{where} must be {{id, type: function, function}}", param=where)
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ApiError(400, f"{where}.function needs string name and arguments", param=where)
    try:
        parsed = arguments_object(arguments)
    except (ValueError, RecursionError):
        raise ApiError(400, f"{where}: arguments must be a JSON object", param=where) from None
    field = f"{where}.function.arguments"
    try:  # "\ud800" escaped in the JSON text: the string is ASCII, its value is not
        _refuse_lone_surrogates(parsed, field)
    except ApiError as exc:
        raise ApiError(400, f"{exc.message} (escaped in the JSON)", param=field) from None
    return ToolCall(
        id=value["id"], type="function", function={"name": name, "arguments": arguments}
    )


def _tool_spec(value: Any, where: str) -> ToolSpec:
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise ApiError(400, f"{where} must be {{type: function, function: {{...}}}}", param=where)
    name = function.get("name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    description = function.get("description", "")
    if not isinstance(name, str) or not name or not isinstance(parameters, dict):
        raise ApiError(400, f"{where}.function needs a name and object parameters", param=where)
    if not isinstance(description, str):
        raise ApiError(400, f"{where}.function.description must be a string", param=where)
    spec: ToolSpec = {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }
    if isinstance(function.get("strict"), bool):
        spec["function"]["strict"] = function["strict"]
    return spec


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
    return tuple(stops)


def _temperature(body: dict[str, Any]) -> float:
    value = _number(body, "temperature", 1.0, low=0.0, high=2.0)
    if (problem := temperature_problem(value)) is not None:
        raise ApiError(400, f"temperature {problem}", param="temperature")
    return value


MAX_NESTING = 64
"""Deepest nesting of a request's JSON walked for strings: deeper is no chat request."""


def _refuse_lone_surrogates(value: Any, where: str, depth: int = 0) -> None:
    """``ApiError(400)`` naming the first string holding a lone UTF-16 surrogate (JSON allows
    ``"\\ud800"``; no tokenizer can encode it) or a nesting deeper than ``MAX_NESTING``."""
    if depth > MAX_NESTING:
        raise ApiError(400, f"{where or 'the body'} is nested too deeply", param=where or None)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400, f"{where or 'a string'} holds a lone UTF-16 surrogate", param=where or None
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, where or "a key", depth + 1)
            _refuse_lone_surrogates(item, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{where}[{index}]", depth + 1)


def _optional(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ApiError(400, f"{name} must be a {kind.__name__}", param=name)
    return value


def _given(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def _integer(value: Any, name: str, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"{name} must be an integer >= {low}, got {value!r}", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"{name} must be at most {high}, got {value}", param=name)
    return value


def _number(
    body: dict[str, Any],
    name: str,
    default: float,
    *,
    low: float,
    high: float,
    low_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number, got {value!r}", param=name)
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(400, f"{name} must be in {bound}, got {value}", param=name)
    return float(value)
