"""Load a resolved model's tokenizer, codec and weights (only here do weights load)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from post_training_cookbook.codecs import Codec, get_codec, infer_codec
from post_training_cookbook.files import BadFileError
from post_training_cookbook.models.catalog import ModelInfo, check_codec_options


def load_tokenizer(info: ModelInfo) -> PreTrainedTokenizerBase:
    return tokenizer_from(info.source)


def tokenizer_from(source: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a hub id or a folder; a folder's that transformers cannot load (a
    ``tokenizer.json`` that is JSON but no tokenizer) raises ``BadFileError`` naming the
    folder, in one line, where transformers' own error is a long traceback naming neither."""
    folder = Path(source)
    if not folder.is_dir():
        return AutoTokenizer.from_pretrained(str(source))
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # KeyError, TypeError, AttributeError ... from its files
        said = f"{type(exc).__name__}: {exc}"[:200]
        raise BadFileError(folder, f"its tokenizer cannot be loaded ({said})") from exc


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


def load_causal_lm(
    source: str | os.PathLike[str] | PreTrainedModel, dtype: torch.dtype
) -> PreTrainedModel:
    """A given model as it is (the trainer casts it); a path's in ``dtype``, whatever the
    folder's own."""
    if isinstance(source, PreTrainedModel):
        return source
    return cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(source, dtype=dtype))


def load_tokenizer_if_any(source: str | os.PathLike[str] | PreTrainedModel) -> Any:
    """The tokenizer saved with ``source`` (saved again with inference checkpoints), or None:
    a given model has none, and a hub model may lack one."""
    if isinstance(source, PreTrainedModel):
        return None
    folder = Path(source)
    if folder.is_dir():
        markers = ("tokenizer.json", "tokenizer_config.json")
        if not any((folder / m).exists() for m in markers):
            return None
        return tokenizer_from(folder)
    try:  # a hub id: the model came from there, the tokenizer may not exist
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError):
        return None


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """transformers' per-layer checkpointing, non-reentrant: it preserves dropout's RNG for
    the recompute, and needs no input that requires grad, so gradients reach a LoRA adapter
    behind frozen embeddings (transformers still hooks the embeddings to require grad, which
    only the reentrant variant needs)."""
    if not model.supports_gradient_checkpointing:
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
