"""The LoRA adapter the trainer trains (peft), with ``trainable_tokens``' rows beside it.

The settings are kept as a plain dict because a training checkpoint records them
(``trainer_state.json``) and a resume compares them with the trainer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from post_training_cookbook.trainer.token_rows import token_row_targets

ADAPTER_NAME = "default"  # peft's name for the single adapter get_peft_model creates


def lora_settings(
    rank: int,
    alpha: int,
    dropout: float,
    target_modules: Sequence[str],
    trainable_tokens: Sequence[str],
) -> dict[str, Any]:
    """The adapter's shape and scale as checkpoints record them."""
    settings: dict[str, Any] = {
        "rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": sorted(target_modules),
    }  # fmt: skip
    if trainable_tokens:  # (absent otherwise: older checkpoints stay compatible)
        settings["trainable_tokens"] = list(trainable_tokens)
    return settings


def with_lora(model: torch.nn.Module, settings: dict[str, Any], token_ids: list[int]) -> PeftModel:
    """``model`` with peft's adapter injected into it (in place), and the rows of
    ``token_ids`` (``trainable_tokens``, resolved) trained in full."""
    config = LoraConfig(
        r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
        target_modules=list(settings["target_modules"]), task_type="CAUSAL_LM",
        trainable_token_indices=token_row_targets(model, token_ids) if token_ids else None,
    )  # fmt: skip
    # peft would keep a bf16 base's adapter in fp32; the precision decides instead.
    return get_peft_model(model, config, autocast_adapter_dtype=False)
