"""Shared pieces of the scale-out tests (``test_scale_*``): no tests live here.

- ``scale``: the marker plus a skip when ray or vllm cannot be imported (they live in the
  ``scale`` extra, installed by ``scripts/test_scale.sh`` into ``.venv-scale``).
- ``build_scale_model(folder)``: a random tied-embedding Llama (hidden 64, 2 layers, head dim 32
  — vLLM's CPU attention needs head dim >= 32) with the tool-use tokenizer of
  ``test_grpo_common.build_tiny_model``.
- ``start_test_ray(ray_home)``: a loopback-only local Ray (``init_local_ray``) with ``TEST_ENV``.
- ``max_abs_diff``: the largest gap between two logprob lists over the positions a mask keeps.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_grpo_common import build_tiny_model
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from post_training_cookbook.engine.vllm import VLLM_ENV_DEFAULTS

HAVE_SCALE_DEPS = all(importlib.util.find_spec(name) for name in ("ray", "vllm"))
scale = [
    pytest.mark.scale,
    pytest.mark.skipif(
        not HAVE_SCALE_DEPS,
        reason="ray and vllm are not importable: install the scale extra "
        "(bash scripts/test_scale.sh builds .venv-scale and runs these tests)",
    ),
]

FP32_BOUND = 2e-3
"""Max |generator − trainer| logprob, both fp32 (measured: ~1e-5)."""
BF16_BOUND = 0.3
"""Max |generator − trainer| logprob when either side computes in bf16 (measured: 0.01–0.26)."""

TEST_ENV = {
    **VLLM_ENV_DEFAULTS,  # loopback only, in-process
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}


def build_scale_model(folder: Path) -> Path:
    """The tool-use tokenizer with a random ``LlamaForCausalLM`` vLLM's CPU build can run."""
    build_tiny_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,  # exercises vLLM's tied-embedding reload bug
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def start_test_ray(ray_home: Path) -> None:
    """A loopback-only local Ray with the test env; its workers inherit that env."""
    from post_training_cookbook.service.ray_env import init_local_ray

    os.environ.update(TEST_ENV)
    init_local_ray(
        num_cpus=8,  # logical: the trainer and up to 7 generators; they share the real cores
        object_store_memory=256 * 1024 * 1024,
        ray_home=ray_home,
    )


def max_abs_diff(a: Sequence[float], b: Sequence[float], mask: Sequence[float]) -> float:
    return max((abs(x - y) for x, y, m in zip(a, b, mask, strict=True) if m > 0), default=0.0)
