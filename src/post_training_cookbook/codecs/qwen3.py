"""Qwen3: the Hermes tool format plus ``<think>`` reasoning, and where it breaks extension.

An assistant turn may open with ``<think>\\n{reasoning}\\n</think>\\n\\n`` before its content
and tool calls. With ``enable_thinking=False`` the generation prompt itself ends with the
empty block ``<think>\\n\\n</think>\\n\\n``. Unlike Qwen2.5 there is no default system prompt.

Where Qwen3's chat template breaks the prefix-extension property (turn k+1's rendering
is not turn k's rendering plus new tokens):

1. Reasoning of assistant turns before the *last user query* is dropped. The last user
   query is the last ``user`` message that is not only ``<tool_response>`` blocks. So as
   soon as a new user turn arrives, every earlier assistant turn loses its ``<think>``
   block; within one query's tool loop the blocks stay.
2. An assistant turn with empty reasoning keeps its (empty) ``<think>`` block only while
   it is the last message; once anything follows, the template renders it without one.
   With ``enable_thinking=False`` this hits every turn: the prompt forced the empty
   block, the history renders none.
3. The template re-spaces what it renders (``reasoning.strip("\\n")``, ``content.lstrip("\\n")``).

What this codec does: token-in-token-out. ``render_extension`` appends only the new
messages after the sampled tokens, which it keeps exactly as sampled, reasoning and
forced empty blocks included. So an episode's training sequence is what the model
actually saw, and it differs from the template's rendering of the whole conversation
at the places above. ``render_prompt`` and ``render_conversation`` follow the template
(for prompts and supervised data); ``render_conversation`` masks a forced empty block
(thinking off) 0 and a sampled one 1.

No Qwen3 tokenizer is available offline; ``templates/qwen3.jinja`` is our transcription
of the documented Qwen3 format, and the tests check this codec against it.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Segment
from post_training_cookbook.codecs.hermes import (
    IM_END,
    IM_START,
    HermesCodec,
    render_tool_calls,
    text_of,
)
from post_training_cookbook.codecs.tool_calls import ParseError
from post_training_cookbook.types import Message, ToolSpec

QWEN3_CHAT_TEMPLATE: str = (
    Path(__file__).with_name("templates").joinpath("qwen3.jinja").read_text("utf-8")
)
"""Our transcription of Qwen3's chat template (see the module docstring), for tests."""

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


class Qwen3Codec(HermesCodec):
    """Qwen3's format; ``enable_thinking=False`` forces the empty think block in each prompt."""

    name = "qwen3"
    options = {"enable_thinking": (True, False)}

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        enable_thinking: bool = True,
        *,
        lenient_json: bool = False,
    ) -> None:
        super().__init__(tokenizer, default_system=None, lenient_json=lenient_json)
        self.enable_thinking = enable_thinking

    def _assistant_segments(self, messages: list[Message], index: int) -> list[Segment]:
        message = messages[index]
        reasoning, content = _reasoning_and_content(message)
        calls = render_tool_calls(message.get("tool_calls") or [], after_content=bool(content))
        header: Segment = (f"{IM_START}assistant\n", False)
        is_last = index == len(messages) - 1
        if index > _last_query_index(messages) and (is_last or reasoning):
            reasoning = reasoning.strip("\n")
            think = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n"
            body = content.lstrip("\n") + calls + IM_END
            return [
                header,
                (think, self.enable_thinking or bool(reasoning)),
                (body, True),
                ("\n", False),
            ]
        return [header, (content + calls + IM_END, True), ("\n", False)]

    def _generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK)

    def _parse_text(self, text: str, tools: list[ToolSpec] | None) -> Message:
        reasoning, rest = _split_reasoning(text)
        message = super()._parse_text(rest, tools)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


def _reasoning_and_content(message: Message) -> tuple[str, str]:
    """The reasoning the template renders for an assistant message, and the rest of its content."""
    content = text_of(message)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if THINK_CLOSE not in content:
        return "", content
    head = content.split(THINK_CLOSE)[0].rstrip("\n")
    return head.split(THINK_OPEN)[-1].lstrip("\n"), content.split(THINK_CLOSE)[-1].lstrip("\n")


def _last_query_index(messages: list[Message]) -> int:
    """The index of the last user message that is not just wrapped tool responses."""
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].get("content")
        if messages[index]["role"] != "user" or not isinstance(content, str):
            continue
        if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
            return index
    return len(messages) - 1


def _split_reasoning(text: str) -> tuple[str | None, str]:
    """The stripped text of a ``<think>`` block (None without one) and the text after it."""
    if THINK_CLOSE not in text:
        if THINK_OPEN in text:
            raise ParseError(f"unterminated {THINK_OPEN} block")
        return None, text
    head, _, rest = text.partition(THINK_CLOSE)
    return head.split(THINK_OPEN)[-1].strip(), rest
