"""Load a resolved model's tokenizer, codec and weights (only here do weights load)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from post_training_cookbook.codecs import Codec, get_codec, infer_codec
from post_training_cookbook.models.catalog import ModelInfo, check_codec_options


def load_tokenizer(info: ModelInfo) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(info.source)


def load_codec(
    info: ModelInfo,
    tokenizer: PreTrainedTokenizerBase | None = None,
    options: Mapping[str, object] | None = None,
) -> Codec:
    """The model's codec; ``options`` (``enable_thinking`` ...) as ``check_codec_options`` takes."""
    chosen = check_codec_options(info, options or {})
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(info)
    if info.codec is None:
        return infer_codec(tokenizer, **chosen)
    return get_codec(info.codec, tokenizer, **chosen)


def load_model(info: ModelInfo, dtype: torch.dtype | str | None = None) -> PreTrainedModel:
    """The causal LM's weights, in ``dtype`` (default: the catalog's ``default_dtype``)."""
    chosen = dtype if dtype is not None else info.default_dtype
    if isinstance(chosen, str):
        chosen = getattr(torch, chosen)
    return AutoModelForCausalLM.from_pretrained(info.source, dtype=chosen)
