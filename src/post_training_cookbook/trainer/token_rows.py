"""Trainable token rows beside LoRA: chosen tokens' embedding and LM-head rows trained in full.

A LoRA adapter changes a weight in a few directions shared by every vocabulary row, so a
token whose rows the base model never trained (a chat template's tool-call tags, reserved
tokens given a new meaning) stays where pretraining left it. Qwen2.5-Coder-0.5B's
``<tool_call>`` is one: its output row sits beside ``<|im_start|>``'s, and after LoRA SFT the
model still wrote ``<|im_start|>`` where the tag belongs (``docs/bfcl_multi_turn.md``). peft's
trainable tokens (``LoraConfig.trainable_token_indices``) train those rows whole: the input
embedding's, and the untied LM head's too (tied heads share the embedding's rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from torch import Tensor

from post_training_cookbook.trainer.types import token_rows_problem

TOKEN_ADAPTER = "token_adapter"
"""The module name peft's wrapper gives its ``TrainableTokensLayer``."""


def check_token_rows(tokens: Sequence[str], use_lora: bool, sharded: bool) -> None:
    """ValueError where ``trainable_tokens`` cannot apply."""
    problem = token_rows_problem(tokens, use_lora, sharded)
    if problem is not None:
        raise ValueError(problem)


def token_ids(tokenizer: Any, tokens: Sequence[str]) -> list[int]:
    """Each of ``tokens``' id in ``tokenizer``'s vocabulary; ValueError for a string that is
    not one token there (it would be several, or unknown)."""
    if not tokens:
        return []
    if tokenizer is None:
        raise ValueError("trainable_tokens needs a tokenizer to find the tokens' ids")
    ids: list[int] = []
    for token in tokens:
        found = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(found, int) or tokenizer.convert_ids_to_tokens(found) != token:
            pieces = tokenizer.tokenize(token)
            raise ValueError(
                f"trainable_tokens: {token!r} is not one token of this tokenizer (it encodes "
                f"as {len(pieces)} pieces: {pieces[:8]}); name tokens as the vocabulary spells "
                "them, e.g. '<tool_call>'"
            )
        ids.append(found)
    if len(set(ids)) != len(ids):
        raise ValueError(f"trainable_tokens names a token twice: {list(tokens)}")
    return ids


def token_row_targets(model: torch.nn.Module, ids: list[int]) -> dict[str, list[int]]:
    """peft's ``trainable_token_indices`` for ``model``: the input embedding's rows, and the
    LM head's when it is a separate weight (peft ties a tied head's rows to the embedding's)."""
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    names = {id(module): name for name, module in model.named_modules()}
    targets = {names[id(embedding)]: ids}
    if head is not None and head.weight is not embedding.weight:
        targets[names[id(head)]] = ids
    return targets


def token_row_layers(model: torch.nn.Module) -> dict[str, TrainableTokensLayer]:
    """``model``'s trainable-token layers by the path of the weight they replace rows of."""
    return {
        weight_owner(name): module
        for name, module in model.named_modules()
        if isinstance(module, TrainableTokensLayer)
    }


def weight_owner(name: str) -> str:
    """A module path without peft's wrappers (``base_layer``, nested for MoE experts, and the
    trainable tokens' ``token_adapter``): the path the base model names its weight under."""
    return ".".join(part for part in name.split(".") if part not in ("base_layer", TOKEN_ADAPTER))


def is_token_row_entry(key: str) -> bool:
    """A state-dict entry of the trainable rows themselves (not a base model weight)."""
    return any(part.startswith("trainable_tokens_") for part in key.split("."))


def with_trained_rows(layer: TrainableTokensLayer, weight: Tensor, adapter: str) -> Tensor:
    """A fresh copy of ``weight`` with ``layer``'s trained rows of ``adapter`` written in."""
    index = torch.tensor(layer.token_indices[adapter], device=weight.device)
    rows = layer.trainable_tokens_delta[adapter].detach().to(weight.dtype)
    return weight.detach().index_copy(0, index, rows)
