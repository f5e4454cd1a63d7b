"""Codecs: chat messages + tool specs ↔ token ids, token-in-token-out (see ``base``).

Families (docs/models.md has the table): ``hermes`` (alias ``qwen2.5``) and ``qwen3-2507``:
Hermes JSON tool calls over ChatML; ``qwen3``: the same plus ``<think>`` reasoning;
``qwen3.5``, ``qwen3.5-nothink``, ``qwen3.6``, ``qwen3.8``: XML tool calls and thinking in
the generation prompt; ``llama3.1``, ``llama3.2``: one JSON call per turn, ``ipython``
results; ``template``: any other tokenizer, through its own chat template.
"""

from __future__ import annotations

from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from post_training_cookbook.codecs.base import Codec, ParsedMessage
from post_training_cookbook.codecs.hermes import (
    HERMES_CHAT_TEMPLATE,
    QWEN25_DEFAULT_SYSTEM,
    HermesCodec,
    detect_default_system,
)
from post_training_cookbook.codecs.inference import infer_codec_name
from post_training_cookbook.codecs.llama3 import Llama3Codec, Llama32Codec
from post_training_cookbook.codecs.qwen3 import QWEN3_CHAT_TEMPLATE, Qwen3Codec
from post_training_cookbook.codecs.qwen35 import (
    Qwen35Codec,
    Qwen35NoThinkCodec,
    Qwen36Codec,
    Qwen38Codec,
)
from post_training_cookbook.codecs.template import NotPrefixPreserving, TemplateCodec
from post_training_cookbook.codecs.tool_calls import to_template_messages


class Qwen3InstructCodec(HermesCodec):
    """Qwen3-Instruct-2507: Qwen2.5's tool format without a default system prompt.

    Like ``hermes``, its template never re-renders earlier turns: extension is exact.
    """

    name = "qwen3-2507"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, lenient_json: bool = False) -> None:
        super().__init__(tokenizer, default_system=None, lenient_json=lenient_json)


CODECS: dict[str, type[Codec]] = {
    "hermes": HermesCodec,
    "qwen2.5": HermesCodec,
    "qwen3": Qwen3Codec,
    "qwen3-2507": Qwen3InstructCodec,
    "qwen3.5": Qwen35Codec,
    "qwen3.5-nothink": Qwen35NoThinkCodec,
    "qwen3.6": Qwen36Codec,
    "qwen3.8": Qwen38Codec,
    "llama3.1": Llama3Codec,
    "llama3.2": Llama32Codec,
    "template": TemplateCodec,
}
"""Codec classes by name, aliases included."""


def get_codec(name: str, tokenizer: PreTrainedTokenizerBase, **options: Any) -> Codec:
    """The codec called ``name`` over ``tokenizer``; ``options`` go to its constructor
    (``enable_thinking`` ...: check a run's choices first with ``models.check_codec_options``).

    For ``hermes``, ``default_system`` is read from the tokenizer's chat template when
    not given (Qwen2.5's template has one, ``HERMES_CHAT_TEMPLATE`` has none).
    ``control_tokens_in_content=True`` (every codec) lets message text that spells a control
    token become it (``Codec.control_tokens_in_content``; off by default).
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}")
    codec_class = CODECS[name]
    control_tokens_in_content = bool(options.pop("control_tokens_in_content", False))
    if codec_class is HermesCodec and "default_system" not in options:
        options["default_system"] = detect_default_system(tokenizer)
    factory: Any = codec_class  # each family's constructor takes its own options
    codec = cast(Codec, factory(tokenizer, **options))
    codec.control_tokens_in_content = control_tokens_in_content
    return codec


def infer_codec(tokenizer: PreTrainedTokenizerBase, **options: Any) -> Codec:
    """The family codec whose format the tokenizer's chat template renders."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    name = infer_codec_name(template) if isinstance(template, str) else None
    if name is None:
        raise ValueError(
            "cannot infer a codec from this tokenizer's chat template (no known family); "
            f"pass a name to get_codec, e.g. 'template' for any template that renders tools: "
            f"one of {sorted(CODECS)}"
        )
    return get_codec(name, tokenizer, **options)


__all__ = [
    "CODECS",
    "HERMES_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN25_DEFAULT_SYSTEM",
    "Codec",
    "HermesCodec",
    "Llama3Codec",
    "Llama32Codec",
    "NotPrefixPreserving",
    "ParsedMessage",
    "Qwen3Codec",
    "Qwen3InstructCodec",
    "Qwen35Codec",
    "Qwen35NoThinkCodec",
    "Qwen36Codec",
    "Qwen38Codec",
    "TemplateCodec",
    "get_codec",
    "infer_codec",
    "infer_codec_name",
    "to_template_messages",
]
