r"""Qwen3.5, Qwen3.6 and Qwen3.8: ChatML, XML tool calls, thinking in the generation prompt.

Rendered text (every message's content is ``strip()``-ed, as the templates' ``trim`` does)::

    <|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>
        {tool json}...</tools>\n\n{format instructions}\n\n{system}<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}\n\n<tool_call>\n
        <function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n<think>\n         (the generation prompt, thinking on)

The model samples from inside the ``<think>`` block the prompt opened. Tool calls are XML
(``xml_calls``); a Qwen3.5 template prints boolean and null values as ``True``/``None``, the
3.6 and 3.8 templates as JSON. Qwen3.8 adds ``reasoning_effort`` (``xhigh``, the default, or
``low`` put an instruction at the top of the system turn; ``medium`` none), turns
``preserve_thinking`` on by default, and no longer reads ``<think>`` written inside content.
The templates raise on a conversation without a user query or with a system message that is
not first; so does this codec.

Where these templates break prefix extension, and what the codec does:

1. An assistant turn keeps its ``<think>`` block only after the last user query (the last
   user message that is not only wrapped ``<tool_response>`` text), unless
   ``preserve_thinking`` is on. So a new user turn drops the reasoning of every earlier
   turn from the re-rendered history; within one query's tool loop nothing changes. With
   thinking off the dropped block is the empty one the prompt forced.
2. Content and reasoning are re-spaced (``strip``), so a sample with other spacing re-renders
   differently.

The codec is token-in-token-out: ``render_extension`` appends the new messages after the
sampled tokens, kept exactly as sampled. ``render_prompt`` and ``render_conversation``
follow the template; ``render_conversation`` masks the forced ``<think>\n`` (or the forced
empty block) 0. With ``preserve_thinking`` on (Qwen3.8's default) break 1 is gone, and a
sample in the template's own spacing extends exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Segment
from post_training_cookbook.codecs.hermes import IM_END, IM_START, HermesCodec, text_of
from post_training_cookbook.codecs.qwen3 import EMPTY_THINK, THINK_CLOSE, THINK_OPEN
from post_training_cookbook.codecs.tool_calls import ParseError, dump_json
from post_training_cookbook.codecs.xml_calls import ValueStyle, parse_xml_calls, render_xml_calls
from post_training_cookbook.types import Message, ToolSpec

TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
ReasoningEffort = Literal["xhigh", "medium", "low"]
REASONING_EFFORTS: tuple[str, ...] = ("xhigh", "medium", "low")
REASONING_INSTRUCTIONS = {
    "xhigh": "Reasoning effort is set to xhigh. Please think carefully through the task, validate "
    "key assumptions, consider plausible alternatives, and prioritize correctness, consistency, "
    "and clarity in the final answer.",
    "medium": "",
    "low": "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly "
    "to the conclusion without unnecessary elaboration.",
}


class Qwen35Codec(HermesCodec):
    """Qwen3.5's format (``qwen3.5``; ``qwen3.5-nothink`` is thinking off by default)."""

    name = "qwen3.5"
    options: ClassVar[Mapping[str, tuple[object, ...]]] = {"enable_thinking": (True, False)}
    value_style: ValueStyle = "python"
    reads_inline_think = True
    """Whether ``<think>...</think>`` written in an assistant's content counts as reasoning."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        enable_thinking: bool = True,
        *,
        preserve_thinking: bool = False,
    ) -> None:
        if preserve_thinking and "preserve_thinking" not in self.options:
            raise ValueError(f"{self.name} has no preserve_thinking option (Qwen3.6 and later)")
        super().__init__(tokenizer, default_system=None)
        self.enable_thinking = enable_thinking
        self.preserve_thinking = preserve_thinking

    def render_extension(
        self, new_messages: list[Message], *, sampled_tokens: list[int]
    ) -> list[int]:
        if any(message["role"] == "system" for message in new_messages):
            raise ValueError(f"{self.name}: a system message must be the first message")
        return super().render_extension(new_messages, sampled_tokens=sampled_tokens)

    def _reasoning_instructions(self) -> str:
        return ""

    def _conversation_segments(
        self, messages: list[Message], tools: list[ToolSpec] | None
    ) -> list[Segment]:
        _last_query_index(messages, self.name)  # raises without one, as the template does
        has_system = messages[0]["role"] == "system"
        system = text_of(messages[0]).strip() if has_system else ""
        segments: list[Segment] = [(self._system_turn_text(system, has_system, tools), False)]
        for index in range(1 if has_system else 0, len(messages)):
            if messages[index]["role"] == "system":
                raise ValueError(f"{self.name}: a system message must be the first message")
            if index == 0 and messages[0]["role"] == "tool":  # nothing before it: no user header
                segments.append((_tool_turn(messages, 0).removeprefix(f"{IM_START}user"), False))
            else:
                segments += self._message_segments(messages, index)
        return segments

    def _system_turn_text(self, system: str, has_system: bool, tools: list[ToolSpec] | None) -> str:
        instructions = self._reasoning_instructions()
        if tools:
            head = instructions + "\n\n" if instructions else ""
            specs = "".join("\n" + dump_json(tool) for tool in tools)
            tail = "\n\n" + system if system else ""
            return (
                f"{IM_START}system\n{head}{TOOLS_PREAMBLE}{specs}{TOOLS_POSTAMBLE}{tail}{IM_END}\n"
            )
        if has_system:
            return f"{IM_START}system\n{system}{IM_END}\n"
        return ""

    def _message_segments(self, messages: list[Message], index: int) -> list[Segment]:
        role = messages[index]["role"]
        if role == "user":
            return [(f"{IM_START}user\n{text_of(messages[index]).strip()}{IM_END}\n", False)]
        if role == "tool":
            return [(_tool_turn(messages, index), False)]
        if role == "assistant":
            return self._assistant_segments(messages, index)
        raise ValueError(f"{self.name}: unexpected message role {role!r}")

    def _assistant_segments(self, messages: list[Message], index: int) -> list[Segment]:
        message = messages[index]
        reasoning, content = self._reasoning_and_content(message)
        calls = render_xml_calls(message.get("tool_calls") or [], content, self.value_style)
        header = f"{IM_START}assistant\n"
        body = content + calls + IM_END
        if not (self.preserve_thinking or index > _last_query_index(messages, self.name)):
            return [(header, False), (body, True), ("\n", False)]
        if not self.enable_thinking and not reasoning:
            return [(header + EMPTY_THINK, False), (body, True), ("\n", False)]
        think_rest = f"{reasoning}\n{THINK_CLOSE}\n\n"
        return [(header + THINK_OPEN + "\n", False), (think_rest + body, True), ("\n", False)]

    def _reasoning_and_content(self, message: Message) -> tuple[str, str]:
        content = text_of(message).strip()
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            return reasoning.strip(), content
        if self.reads_inline_think and THINK_CLOSE in content:
            head, tail = content.split(THINK_CLOSE)[0], content.split(THINK_CLOSE)[-1]
            return head.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n").strip(), tail.lstrip("\n")
        return "", content

    def _generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + (
            THINK_OPEN + "\n" if self.enable_thinking else EMPTY_THINK
        )

    def _parse_text(self, text: str, tools: list[ToolSpec] | None) -> Message:
        if self.enable_thinking:
            if THINK_CLOSE not in text:
                raise ParseError(f"unterminated {THINK_OPEN} block (the prompt opened it)")
            head, _, text = text.partition(THINK_CLOSE)
            reasoning: str | None = head.strip().removeprefix(THINK_OPEN).strip()
        else:
            reasoning = None
        if THINK_OPEN in text or THINK_CLOSE in text:
            raise ParseError(f"a stray {THINK_OPEN} or {THINK_CLOSE} tag after the reasoning")
        content, calls = parse_xml_calls(text, tools)
        message = Message(role="assistant", content=content)
        if calls:
            message["tool_calls"] = calls
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class Qwen35NoThinkCodec(Qwen35Codec):
    """Qwen3.5's small models (2B and under): the same template with thinking off by default."""

    name = "qwen3.5-nothink"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, enable_thinking: bool = False) -> None:
        super().__init__(tokenizer, enable_thinking)


class Qwen36Codec(Qwen35Codec):
    """Qwen3.6's format: Qwen3.5's plus ``preserve_thinking``, and JSON scalar values."""

    name = "qwen3.6"
    options = {"enable_thinking": (True, False), "preserve_thinking": (True, False)}
    value_style: ValueStyle = "json"


class Qwen38Codec(Qwen36Codec):
    """Qwen3.8's format: ``reasoning_effort``, ``preserve_thinking`` on by default."""

    name = "qwen3.8"
    options = {
        "enable_thinking": (True, False),
        "preserve_thinking": (True, False),
        "reasoning_effort": REASONING_EFFORTS,
    }
    reads_inline_think = False

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        enable_thinking: bool = True,
        *,
        preserve_thinking: bool = True,
        reasoning_effort: ReasoningEffort = "xhigh",
    ) -> None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(
                f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}"
            )
        super().__init__(tokenizer, enable_thinking, preserve_thinking=preserve_thinking)
        self.reasoning_effort = reasoning_effort

    def _reasoning_instructions(self) -> str:
        return REASONING_INSTRUCTIONS[self.reasoning_effort] if self.enable_thinking else ""

    def _system_turn_text(self, system: str, has_system: bool, tools: list[ToolSpec] | None) -> str:
        if tools:
            return super()._system_turn_text(system, has_system, tools)
        instructions = self._reasoning_instructions()
        text = "\n\n".join(part for part in (instructions, system) if part)
        return f"{IM_START}system\n{text}{IM_END}\n" if text else ""


def _last_query_index(messages: list[Message], codec_name: str) -> int:
    """The index of the last user message that is not only wrapped tool responses."""
    for index in range(len(messages) - 1, -1, -1):
        content = text_of(messages[index]).strip()
        if messages[index]["role"] != "user":
            continue
        if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
            return index
    raise ValueError(f"{codec_name}: no user query in the conversation (the template needs one)")


def _tool_turn(messages: list[Message], index: int) -> str:
    """A tool result; consecutive results share one ``user`` turn."""
    opens = index == 0 or messages[index - 1]["role"] != "tool"
    closes = index == len(messages) - 1 or messages[index + 1]["role"] != "tool"
    body = f"\n<tool_response>\n{text_of(messages[index]).strip()}\n</tool_response>"
    return (f"{IM_START}user" if opens else "") + body + (f"{IM_END}\n" if closes else "")
