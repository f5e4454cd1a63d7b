r"""The Hermes tool format over ChatML, as Qwen2.5 instruct models use it.

Rendered text, turn by turn (``HERMES_CHAT_TEMPLATE`` renders the same):

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{tool json}\n</tools> ... <|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
        <|im_end|>\n   (the last two lines are one; each further call adds \n<tool_call>...)
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...<|im_end|>\n

Consecutive ``tool`` messages share one ``user`` turn. The codec renders this text in
Python (not through the tokenizer's template), so the prompt, the extensions and the
training mask come from one place; the tests check it against the Jinja template token
for token. Tool-call arguments are rendered canonically (``tool_calls.canonical_arguments``):
what a template's ``tojson`` prints for ``to_template_messages(messages)``.

Every rendered prefix ends on a special token or on ``assistant\n``, so token-in-token-out
extension is exact: prompt + sampled + ``render_extension(...)`` tokenizes like the
template's rendering of the whole conversation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Codec, ParsedMessage, Segment
from post_training_cookbook.codecs.tool_calls import (
    ParseError,
    canonical_arguments,
    dump_json,
    split_bare_json_calls,
    split_tagged_calls,
)
from post_training_cookbook.types import Message, ToolCall, ToolSpec, content_text

HERMES_CHAT_TEMPLATE: str = (
    Path(__file__).with_name("templates").joinpath("hermes.jinja").read_text("utf-8")
)
"""The Jinja chat template of this format; its ``default_system`` variable is unset by default."""

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""What Qwen2.5's own template puts in the system turn when there is no system message."""

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments"
    " within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_tool_call(call: ToolCall) -> str:
    """One ``<tool_call>`` block with canonical arguments."""
    function = call["function"]
    arguments = canonical_arguments(function["arguments"])
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


def render_tool_calls(calls: list[ToolCall], *, after_content: bool) -> str:
    """The blocks of an assistant turn, each after a newline except a first one with no content."""
    return "".join(
        ("\n" if after_content or number else "") + render_tool_call(call)
        for number, call in enumerate(calls)
    )


def text_of(message: Message) -> str:
    """A message's content, ``""`` when it has none."""
    return content_text(message.get("content")) or ""


def single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """The id of ``token`` if the tokenizer encodes it as one token, else ``None``."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def detect_default_system(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system prompt the tokenizer's chat template adds when a conversation has none."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return None
    probe = [{"role": "user", "content": "probe"}]
    text = tokenizer.apply_chat_template(probe, tokenize=False)
    header = f"{IM_START}system\n"
    if not isinstance(text, str) or not text.startswith(header) or IM_END not in text:
        return None
    return text[len(header) : text.index(IM_END)]


class HermesCodec(Codec):
    """Qwen2.5 / Hermes: ChatML turns, tools in the system turn, calls in ``<tool_call>`` tags.

    ``default_system``: the system prompt rendered when the conversation has none
    (``QWEN25_DEFAULT_SYSTEM`` for Qwen2.5's own template, ``None`` for ``HERMES_CHAT_TEMPLATE``).
    ``lenient_json``: when the sample has no ``<tool_call>`` tags, also take bare or
    fenced JSON objects with ``"name"`` and ``"arguments"`` as calls (Qwen2.5-0.5B's habit).
    """

    name = "hermes"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        default_system: str | None = None,
        lenient_json: bool = False,
    ) -> None:
        im_end_id = single_token_id(tokenizer, IM_END)
        if im_end_id is None:
            raise ValueError(f"{type(self).__name__} needs {IM_END!r} as a single token")
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.lenient_json = lenient_json
        self._im_end_id = im_end_id
        candidates = [im_end_id, tokenizer.eos_token_id, single_token_id(tokenizer, END_OF_TEXT)]
        self._stop_token_ids = tuple(dict.fromkeys(i for i in candidates if isinstance(i, int)))

    def render_prompt(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        text = _join(self._conversation_segments(messages, tools)) + self._generation_prompt()
        return self._encode_rendered(text, messages)

    def render_extension(
        self, new_messages: list[Message], *, sampled_tokens: list[int]
    ) -> list[int]:
        if any(message["role"] == "assistant" for message in new_messages):
            raise ValueError("render_extension renders only non-assistant messages")
        closed = bool(sampled_tokens) and sampled_tokens[-1] == self._im_end_id
        segments = [
            s for i in range(len(new_messages)) for s in self._message_segments(new_messages, i)
        ]
        tokens = self._encode_rendered(
            "\n" + _join(segments) + self._generation_prompt(), new_messages
        )
        return tokens if closed else [self._im_end_id, *tokens]

    def parse(
        self, sampled_tokens: list[int], tools: list[ToolSpec] | None = None
    ) -> ParsedMessage:
        return parse_guarded(
            self.tokenizer, sampled_tokens, self._stop_token_ids, tools, self._parse_text
        )

    def render_conversation(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[int]]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        return self._encode_conversation(self._conversation_segments(messages, tools), messages)

    # The format, as text segments; subclasses change the pieces that differ.

    def _conversation_segments(
        self, messages: list[Message], tools: list[ToolSpec] | None
    ) -> list[Segment]:
        segments: list[Segment] = [(self._system_turn(messages, tools), False)]
        first = 1 if messages[0]["role"] == "system" else 0
        for index in range(first, len(messages)):
            segments += self._message_segments(messages, index)
        return segments

    def _system_turn(self, messages: list[Message], tools: list[ToolSpec] | None) -> str:
        system = text_of(messages[0]) if messages[0]["role"] == "system" else self.default_system
        if tools:
            head = "" if system is None else system + "\n\n"
            specs = "".join("\n" + dump_json(tool) for tool in tools)
            return f"{IM_START}system\n{head}{TOOLS_PREAMBLE}{specs}{TOOLS_POSTAMBLE}{IM_END}\n"
        return "" if system is None else f"{IM_START}system\n{system}{IM_END}\n"

    def _message_segments(self, messages: list[Message], index: int) -> list[Segment]:
        message = messages[index]
        role = message["role"]
        if role in ("user", "system"):
            return [(f"{IM_START}{role}\n{text_of(message)}{IM_END}\n", False)]
        if role == "assistant":
            return self._assistant_segments(messages, index)
        if role == "tool":
            return [(_tool_response(messages, index), False)]
        raise ValueError(f"unknown message role {role!r}")

    def _assistant_segments(self, messages: list[Message], index: int) -> list[Segment]:
        content = text_of(messages[index])
        calls = render_tool_calls(
            messages[index].get("tool_calls") or [], after_content=bool(content)
        )
        return [(f"{IM_START}assistant\n", False), (content + calls + IM_END, True), ("\n", False)]

    def _generation_prompt(self) -> str:
        return f"{IM_START}assistant\n"

    def _parse_text(self, text: str, tools: list[ToolSpec] | None) -> Message:
        content, calls = split_tagged_calls(text)
        if not calls and self.lenient_json:
            content, calls = split_bare_json_calls(content)
        message = Message(role="assistant", content=content)
        if calls:
            message["tool_calls"] = calls
        return message


def parse_guarded(
    tokenizer: PreTrainedTokenizerBase,
    sampled_tokens: list[int],
    stop_token_ids: tuple[int, ...],
    tools: list[ToolSpec] | None,
    parse_text: Callable[[str, list[ToolSpec] | None], Message],
) -> ParsedMessage:
    """``parse_text`` of the decoded sample (its stop token dropped); failures, never raises.

    Model output can be anything: ids outside the vocabulary, JSON nested past the recursion
    limit, integers too long to convert. All of them are a failed parse, not an exception.
    """
    if sampled_tokens and sampled_tokens[-1] in stop_token_ids:
        sampled_tokens = sampled_tokens[:-1]
    try:
        text = str(
            tokenizer.decode(
                sampled_tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )
        return ParsedMessage(parse_text(text, tools))
    except ParseError as error:
        return ParsedMessage(None, str(error))
    except (ValueError, RecursionError, OverflowError, TypeError, IndexError) as error:
        return ParsedMessage(None, f"unparseable sample ({type(error).__name__}: {error})")


def _join(segments: list[Segment]) -> str:
    return "".join(piece for piece, _ in segments)


def _tool_response(messages: list[Message], index: int) -> str:
    """A tool result; consecutive results share one ``user`` turn."""
    opens = index == 0 or messages[index - 1]["role"] != "tool"
    closes = index == len(messages) - 1 or messages[index + 1]["role"] != "tool"
    body = f"\n<tool_response>\n{text_of(messages[index])}\n</tool_response>"
    return (f"{IM_START}user" if opens else "") + body + (f"{IM_END}\n" if closes else "")
