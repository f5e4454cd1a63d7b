"""Codecs: chat messages + tool specs ↔ token ids, token-in-token-out (see ``base``).

Families: ``"hermes"`` (alias ``"qwen2.5"``): Qwen2.5 / Hermes tool calls; ``"qwen3"``:
the same plus ``<think>`` reasoning.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Codec, ParsedMessage
from post_training_cookbook.codecs.hermes import (
    HERMES_CHAT_TEMPLATE,
    QWEN25_DEFAULT_SYSTEM,
    HermesCodec,
    detect_default_system,
)
from post_training_cookbook.codecs.qwen3 import QWEN3_CHAT_TEMPLATE, Qwen3Codec
from post_training_cookbook.codecs.tool_calls import to_template_messages

CODECS: dict[str, type[HermesCodec]] = {
    "hermes": HermesCodec,
    "qwen2.5": HermesCodec,
    "qwen3": Qwen3Codec,
}
"""Codec classes by name, aliases included."""


def get_codec(name: str, tokenizer: PreTrainedTokenizerBase, **options: Any) -> Codec:
    """The codec called ``name`` over ``tokenizer``; ``options`` go to its constructor.

    For ``hermes``, ``default_system`` is read from the tokenizer's chat template when
    not given (Qwen2.5's template has one, ``HERMES_CHAT_TEMPLATE`` has none).
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}")
    codec_class = CODECS[name]
    if codec_class is HermesCodec and "default_system" not in options:
        options["default_system"] = detect_default_system(tokenizer)
    return codec_class(tokenizer, **options)


def infer_codec(tokenizer: PreTrainedTokenizerBase) -> Codec:
    """The codec whose format the tokenizer's chat template renders: qwen3 or hermes."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if isinstance(template, str) and "<think>" in template:
        return get_codec("qwen3", tokenizer)
    if isinstance(template, str) and "<tool_call>" in template:
        return get_codec("hermes", tokenizer)
    raise ValueError(
        "cannot infer a codec from this tokenizer's chat template (no <think> or <tool_call>); "
        f"pass a name to get_codec: one of {sorted(CODECS)}"
    )


__all__ = [
    "CODECS",
    "HERMES_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN25_DEFAULT_SYSTEM",
    "Codec",
    "HermesCodec",
    "ParsedMessage",
    "Qwen3Codec",
    "get_codec",
    "infer_codec",
    "to_template_messages",
]
