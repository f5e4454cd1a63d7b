"""Tiny random hybrid models (Qwen3.5's architecture: Gated DeltaNet layers beside full
attention), the kind the hosted guide's ``Qwen/Qwen3.8-27B`` and ``Qwen/Qwen3.6-35B-A3B`` are.

``build_tiny_hybrid(folder, tokenizer_dir, moe=...)``: 4 layers (3 linear-attention, 1
full-attention), hidden size 32; with ``moe``, a ``Qwen3_5MoeForCausalLM`` whose every MLP
routes over 4 experts, 2 per token, beside a shared expert. The tokenizer (with its chat
template) is copied from ``tokenizer_dir``, so the folder works as ``GRPOConfig.model``.
No tests live here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def hybrid_config(vocab_size: int, moe: bool, **special: Any) -> Any:
    shared: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": LAYER_TYPES,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        **special,
    }
    if moe:
        return Qwen3_5MoeTextConfig(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            **shared,
        )
    return Qwen3_5TextConfig(intermediate_size=64, **shared)


def tiny_hybrid_model(vocab_size: int, moe: bool, **special: Any) -> torch.nn.Module:
    """A random tiny hybrid (seeded: the same weights each call)."""
    torch.manual_seed(0)
    config = hybrid_config(vocab_size, moe, **special)
    model = Qwen3_5MoeForCausalLM(config) if moe else Qwen3_5ForCausalLM(config)
    return model.eval()


def build_tiny_hybrid(folder: Path, tokenizer_dir: Path | None = None, *, moe: bool) -> Path:
    """A random tiny hybrid saved in ``folder``; with ``tokenizer_dir``, its tokenizer too
    (the vocabulary then fits it) and weights that end a turn early (``ending_turns``),
    else a vocabulary of 128 ids."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tiny_hybrid_model(128, moe).save_pretrained(folder)
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(folder)
    special = {
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    model = tiny_hybrid_model(len(tokenizer), moe, **special)
    ending_turns(model, tokenizer.eos_token_id)
    model.save_pretrained(folder)
    return folder


def ending_turns(model: torch.nn.Module, eos: int, logit: float = 5.0) -> None:
    """Make ``eos`` about ``logit`` more likely than other tokens after any context, so that
    a random model's turns end after a few tokens (p(eos) ~ 0.2 over 600 ids) instead of at
    the token limit: every input embedding carries 1.0 in hidden dimension 0, which the
    final norm scales to ~sqrt(hidden), and only ``eos``'s output row reads it."""
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 1.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[eos, 0] = logit / hidden**0.5
