r"""Llama 3.1 and 3.2 instruct: header-framed turns, one JSON tool call, ``ipython`` results.

Rendered text (``{bos}`` is ``<|begin_of_text|>``; ``H(role)`` is
``<|start_header_id|>{role}<|end_header_id|>\n\n``)::

    {bos}H(system)Environment: ipython\nCutting Knowledge Date: December 2023\n
        Today Date: {date}\n\n{system}<|eot_id|>        (no "Environment" line without tools)
    H(user)Given the following functions, ... {tool json, indent 4}\n\n{first user}<|eot_id|>
    H(assistant){content}<|eot_id|>
    H(assistant){"name": "NAME", "parameters": {arguments json}}<|eot_id|>
    H(ipython)"{result as a JSON string}"<|eot_id|>
    H(assistant)                                       (the generation prompt)

Tools go into the first user message (``tools_in_user_message``, the templates' default).
Content is ``strip()``-ed. Llama 3.1's date defaults to 26 Jul 2024; Llama 3.2's template
prints today's date, which this codec fixes when it is built (``date_string`` overrides
both). Built-in tools (``<|python_tag|>`` calls, ``<|eom_id|>``) are not rendered.

Where these templates break prefix extension, and what the codec does:

1. An assistant turn with a tool call is rendered as the call alone: its content is dropped.
   So a sample that writes text and then the call re-renders without the text.
2. Content is re-spaced (``strip``).
3. One call per turn: the templates raise on more, and so does rendering here; a sample
   with two call objects is a parse failure.

The codec is token-in-token-out: sampled tokens stay as sampled, and the extension adds only
the new turns, so an episode's tokens are what the model saw. A sample is a tool call when it
is one JSON object with ``"name"`` and ``"parameters"`` (or ``"arguments"``), optionally after
``<|python_tag|>``; anything else is content.
"""

from __future__ import annotations

import datetime
import json
import re

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Codec, ParsedMessage, Segment
from post_training_cookbook.codecs.hermes import parse_guarded, single_token_id, text_of
from post_training_cookbook.codecs.tool_calls import (
    ParseError,
    arguments_object,
    dump_json,
    make_tool_call,
)
from post_training_cookbook.types import Message, ToolSpec

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
PYTHON_TAG = "<|python_tag|>"
LLAMA31_DATE = "26 Jul 2024"
TOOLS_INSTRUCTION = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.Do not use variables.\n\n"
)
SYSTEM_TOOLS_INSTRUCTION = (
    "You have access to the following functions. To call a function, please respond with JSON "
    'for a function call.Respond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.Do not use variables.\n\n"
)
_CALL_START = re.compile(r'\{\s*"name"\s*:')
_ARGUMENTS_KEY = re.compile(r'"(?:parameters|arguments)"\s*:')


def header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


class Llama3Codec(Codec):
    """Llama 3.1's format (``llama3.1``); ``llama3.2`` differs only in its default date."""

    name = "llama3.1"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        date_string: str | None = None,
        tools_in_user_message: bool = True,
    ) -> None:
        eot_id = single_token_id(tokenizer, EOT)
        if eot_id is None or single_token_id(tokenizer, header("x")[:19]) is None:
            raise ValueError(
                f"{type(self).__name__} needs {EOT!r} and the header tokens as single tokens"
            )
        self.tokenizer = tokenizer
        self.date_string = date_string if date_string is not None else self.default_date()
        self.tools_in_user_message = tools_in_user_message
        self._eot_id = eot_id
        candidates = [
            eot_id,
            single_token_id(tokenizer, EOM),
            single_token_id(tokenizer, END_OF_TEXT),
        ]
        self._stop_token_ids = tuple(dict.fromkeys(i for i in candidates if i is not None))

    @staticmethod
    def default_date() -> str:
        return LLAMA31_DATE

    def render_prompt(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        text = "".join(piece for piece, _ in self._conversation_segments(messages, tools))
        return self._encode_rendered(text + header("assistant"), messages)

    def render_extension(
        self, new_messages: list[Message], *, sampled_tokens: list[int]
    ) -> list[int]:
        if any(message["role"] == "assistant" for message in new_messages):
            raise ValueError("render_extension renders only non-assistant messages")
        closed = bool(sampled_tokens) and sampled_tokens[-1] in self._stop_token_ids
        text = "".join(piece for m in new_messages for piece, _ in self._message_segments(m))
        tokens = self._encode_rendered(text + header("assistant"), new_messages)
        return tokens if closed else [self._eot_id, *tokens]

    def parse(
        self, sampled_tokens: list[int], tools: list[ToolSpec] | None = None
    ) -> ParsedMessage:
        return parse_guarded(
            self.tokenizer, sampled_tokens, self._stop_token_ids, tools, _parse_text
        )

    def render_conversation(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[int]]:
        return self._encode_conversation(self._conversation_segments(messages, tools), messages)

    def _conversation_segments(
        self, messages: list[Message], tools: list[ToolSpec] | None
    ) -> list[Segment]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        system = text_of(messages[0]).strip() if messages[0]["role"] == "system" else ""
        rest = messages[1:] if messages[0]["role"] == "system" else messages
        head = BEGIN_OF_TEXT + header("system")
        head += "Environment: ipython\n" if tools else ""
        head += f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n"
        if tools and not self.tools_in_user_message:
            head += SYSTEM_TOOLS_INSTRUCTION + _tool_listing(tools)
        segments: list[Segment] = [(head + system + EOT, False)]
        if tools and self.tools_in_user_message:
            if not rest:
                raise ValueError("cannot put the tools in the first user message: there is none")
            first = text_of(rest[0]).strip()
            listing = TOOLS_INSTRUCTION + _tool_listing(tools)
            segments.append((header("user") + listing + first + EOT, False))
            rest = rest[1:]
        for message in rest:
            segments += self._message_segments(message)
        return segments

    def _message_segments(self, message: Message) -> list[Segment]:
        role = message["role"]
        if role in ("tool", "ipython"):
            return [(header("ipython") + dump_json(text_of(message)) + EOT, False)]
        if "tool_calls" not in message and role != "assistant":
            return [(header(role) + text_of(message).strip() + EOT, False)]
        if "tool_calls" not in message:
            return [(header(role), False), (text_of(message).strip() + EOT, True)]
        calls = message["tool_calls"]
        if len(calls) != 1:
            raise ValueError(f"Llama 3 renders exactly one tool call per turn, got {len(calls)}")
        function = calls[0]["function"]
        arguments = dump_json(arguments_object(function["arguments"]))
        body = f'{{"name": "{function["name"]}", "parameters": {arguments}}}'
        return [(header("assistant"), False), (body + EOT, True)]


class Llama32Codec(Llama3Codec):
    """Llama 3.2's format: today's date (fixed when the codec is built) unless given."""

    name = "llama3.2"

    @staticmethod
    def default_date() -> str:
        return datetime.datetime.now().strftime("%d %b %Y")


def _tool_listing(tools: list[ToolSpec]) -> str:
    return "".join(json.dumps(tool, ensure_ascii=False, indent=4) + "\n\n" for tool in tools)


def _parse_text(text: str, tools: list[ToolSpec] | None) -> Message:
    """A tool call when the sample is one call object, else the sample as content.

    A sample that opens like a call (``{"name": ...`` with ``"parameters"`` or
    ``"arguments"`` in it) but is not exactly one valid call object is a parse failure.
    """
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    looks_like_call = bool(_CALL_START.match(stripped)) and bool(_ARGUMENTS_KEY.search(stripped))
    if not looks_like_call:
        return Message(role="assistant", content=text.strip())
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError as error:
        raise ParseError(f"tool call: invalid JSON ({error})") from None
    if stripped[end:].strip():
        raise ParseError("text after the tool call (Llama 3 makes one call per turn, alone)")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ParseError('tool call: missing a non-empty string "name"')
    key = "parameters" if "parameters" in value else "arguments"
    arguments = value.get(key)
    if not isinstance(arguments, dict):
        raise ParseError(f'tool call: "{key}" must be a JSON object')
    call = make_tool_call(value["name"], arguments)
    return Message(role="assistant", content="", tool_calls=[call])
