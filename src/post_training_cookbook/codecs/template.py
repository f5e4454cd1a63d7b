"""A codec driven by the tokenizer's own chat template, for families without a codec here.

``render_prompt`` is ``apply_chat_template`` of the conversation with a generation prompt.
``render_extension`` is the template's rendering of (conversation + new messages) minus its
rendering of the conversation, cut right after the assistant turn's stop token. A codec sees
only the new messages, so "the conversation" is a stand-in: one user turn and the assistant
message parsed back from the sample. That equals the real difference for every template whose
rendering of new messages depends only on the turn before them; the tests check it against
whole real conversations.

Where the template is not prefix-preserving (re-rendering the conversation with the new
messages changes the text of earlier turns, as Qwen3's and gpt-oss's templates do when a new
user turn drops earlier reasoning), no extension can be token-in-token-out: the codec raises
``NotPrefixPreserving``, naming the model, instead of guessing. ``render_conversation``
raises it too when a turn's rendering as the last message is not a prefix of the whole
conversation's, since it finds the sampled spans that way.

Parsing goes through transformers' response parsing: the tokenizer's ``response_template``
(a model repository may ship one; TRL's ``add_response_schema`` sets one for known
templates). A tokenizer without one is refused when the codec is built, so a run fails
before any engine starts.
"""

from __future__ import annotations

import json
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Codec, ParsedMessage, Segment
from post_training_cookbook.codecs.hermes import parse_guarded, single_token_id
from post_training_cookbook.codecs.tool_calls import (
    ParseError,
    make_tool_call,
    to_template_messages,
)
from post_training_cookbook.types import Message, ToolSpec

_PROBE_USER = Message(role="user", content="Hello.")
_SENTINELS = ("probe_tool_a8f3", "probe_key_b9d4", "probe_value_d6e7", "probe_result_c4f9")


class NotPrefixPreserving(ValueError):
    """The chat template re-renders earlier turns differently once new messages follow."""


class TemplateCodec(Codec):
    """Any tokenizer whose chat template renders tools and that declares a response template.

    ``stop_tokens``: extra tokens that end an assistant turn (besides the tokenizer's EOS and
    the end-of-turn tokens the template renders). ``template_kwargs`` go to every
    ``apply_chat_template`` call (e.g. ``enable_thinking``).
    """

    name = "template"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        stop_tokens: tuple[str, ...] = (),
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.model = str(getattr(tokenizer, "name_or_path", "") or "this tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model!r}: the tokenizer has no chat template")
        self._check_tools_render()
        if getattr(tokenizer, "response_template", None) is None:
            raise ValueError(
                f"model {self.model!r}: codec 'template' parses samples with transformers' "
                "response parsing, but the tokenizer has no `response_template`. Set "
                "tokenizer.response_template (transformers' chat response parsing docs; TRL's "
                "add_response_schema knows some templates), or use a family codec "
                "(docs/models.md)."
            )
        self._prompt_prefix = self._render([_PROBE_USER], None, generation_prompt=True)
        self._stop_texts = self._end_of_turn_texts(stop_tokens)
        ids = (single_token_id(tokenizer, text) for text in self._stop_texts)
        stop_ids = [i for i in ids if i is not None]
        if isinstance(tokenizer.eos_token_id, int):
            stop_ids.append(tokenizer.eos_token_id)
        self._stop_token_ids = tuple(dict.fromkeys(stop_ids))
        if not self._stop_token_ids:
            raise ValueError(f"model {self.model!r}: no single-token end of turn found")

    def render_prompt(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        return self._encode_rendered(
            self._render(messages, tools, generation_prompt=True), messages
        )

    def render_extension(
        self, new_messages: list[Message], *, sampled_tokens: list[int]
    ) -> list[int]:
        if any(message["role"] == "assistant" for message in new_messages):
            raise ValueError("render_extension renders only non-assistant messages")
        parsed = self.parse(sampled_tokens)
        if parsed.message is None:
            raise ValueError(f"model {self.model!r}: the sample does not parse: {parsed.error}")
        before = [_PROBE_USER, parsed.message]
        done, stop_text = self._through_turn(before)
        after = self._render([*before, *new_messages], None, generation_prompt=True)
        if not after.startswith(done):
            raise self._not_prefix_preserving([m["role"] for m in new_messages])
        tokens = self._encode_rendered(after[len(done) :], new_messages)
        closed = bool(sampled_tokens) and sampled_tokens[-1] in self._stop_token_ids
        stop_id = single_token_id(self.tokenizer, stop_text) if stop_text else None
        return tokens if closed or stop_id is None else [stop_id, *tokens]

    def parse(
        self, sampled_tokens: list[int], tools: list[ToolSpec] | None = None
    ) -> ParsedMessage:
        return parse_guarded(self.tokenizer, sampled_tokens, (), tools, self._parse_text)

    def render_conversation(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[int]]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        whole = self._render(messages, tools, generation_prompt=False)
        segments: list[Segment] = []
        position = 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or index == 0:  # a first turn stays forced
                continue
            prompt = self._render(messages[:index], tools, generation_prompt=True)
            through, _ = self._through_turn(messages[: index + 1], tools)
            if not (whole.startswith(prompt) and whole.startswith(through)):
                raise self._not_prefix_preserving([m["role"] for m in messages[index:]])
            segments += [
                (whole[position : len(prompt)], False),
                (whole[len(prompt) : len(through)], True),
            ]
            position = len(through)
        segments.append((whole[position:], False))
        return self._encode_conversation([s for s in segments if s[0]], messages)

    # ---- helpers ----

    def _render(
        self, messages: list[Message], tools: list[ToolSpec] | None, *, generation_prompt: bool
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages),
            tools=cast(Any, tools or None),
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        return str(text)

    def _through_turn(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[str, str | None]:
        """The rendering up to the stop token of the last (assistant) turn, and that token."""
        text = self._render(messages, tools, generation_prompt=False)
        found = [(text.rfind(stop), stop) for stop in self._stop_texts if stop in text]
        if not found:
            return text, None
        position, stop = max(found, key=lambda pair: pair[0] + len(pair[1]))
        return text[: position + len(stop)], stop

    def _end_of_turn_texts(self, extra: tuple[str, ...]) -> tuple[str, ...]:
        """The special tokens that close an assistant turn, with and without a tool call."""
        found = list(extra)
        if isinstance(self.tokenizer.eos_token, str):
            found.append(self.tokenizer.eos_token)
        for assistant in (Message(role="assistant", content="Hi."), _probe_call()):
            text = self._render([_PROBE_USER, assistant], None, generation_prompt=False).rstrip()
            specials = [t for t in self.tokenizer.all_special_tokens if text.endswith(t)]
            specials += [t for t in self._added_tokens() if text.endswith(t)]
            if specials:
                found.append(max(specials, key=len))
        return tuple(dict.fromkeys(found))

    def _added_tokens(self) -> list[str]:
        return [str(token) for token in self.tokenizer.get_added_vocab()]

    def _check_tools_render(self) -> None:
        name, key, value, result = _SENTINELS
        tool: ToolSpec = {
            "type": "function",
            "function": {"name": name, "description": "probe", "parameters": {"type": "object"}},
        }
        probe = [_PROBE_USER, _probe_call(), Message(role="tool", content=result, name=name)]
        try:
            text = self._render(probe, [tool], generation_prompt=False)
        except Exception as error:  # a template raising on a tool exchange cannot run GRPO
            raise ValueError(
                f"model {self.model!r}: its chat template fails on a tool-call exchange ({error})"
            ) from None
        missing = [s for s in (name, key, value, result) if s not in text]
        if missing:
            raise ValueError(
                f"model {self.model!r}: its chat template does not render tool calls and "
                f"results (dropped: {missing}); GRPO with tools needs a template that does"
            )

    def _parse_text(self, text: str, tools: list[ToolSpec] | None) -> Message:
        parsed = self.tokenizer.parse_response(
            text, prefix=self._prompt_prefix, tools=cast(Any, tools)
        )
        if not isinstance(parsed, dict):
            raise ParseError(f"the response parser returned {type(parsed).__name__}")
        content = parsed.get("content")
        message = Message(role="assistant", content=content if isinstance(content, str) else "")
        calls = [
            _tool_call(call, number)
            for number, call in enumerate(parsed.get("tool_calls") or [], 1)
        ]
        if calls:
            message["tool_calls"] = calls
        reasoning = parsed.get("reasoning_content", parsed.get("thinking"))
        if isinstance(reasoning, str):
            message["reasoning_content"] = reasoning
        return message

    def _not_prefix_preserving(self, roles: list[str]) -> NotPrefixPreserving:
        return NotPrefixPreserving(
            f"model {self.model!r}: its chat template is not prefix-preserving: appending "
            f"{roles or 'messages'} re-renders the earlier turns differently, so the codec cannot "
            "extend the sampled tokens as they are. Use a family codec that handles this "
            "template (docs/models.md) or a prefix-preserving template."
        )


def _probe_call() -> Message:
    name, key, value, _ = _SENTINELS
    call = make_tool_call(name, {key: value})
    return Message(role="assistant", content="", tool_calls=[call])


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """``to_template_messages``, with ``reasoning_content`` also as ``thinking``: the field
    gpt-oss's and LFM2's templates read it from."""
    return [
        {**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m
        for m in to_template_messages(messages)
    ]


def _tool_call(value: Any, number: int) -> Any:
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ParseError(f"tool call {number}: no function name")
    arguments = function.get("arguments", {}) if isinstance(function, dict) else {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ParseError(f"tool call {number}: arguments must be an object")
    return make_tool_call(name, arguments)
