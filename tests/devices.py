"""The devices tests run on: the CPU always, CUDA where present (``scripts/gpu_check.sh`` and
``scripts/gpu_hybrid_check.sh`` run the CUDA cases, marked ``cuda``, on a GPU machine)."""

from __future__ import annotations

import functools

import pytest
import torch

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ],
)
DEVICES = ["cpu", CUDA]
"""Parametrize a test over these: ``@pytest.mark.parametrize("device", DEVICES)``."""


@functools.cache
def fp32_gated_delta_problem(device: str) -> str | None:
    """Why a Qwen3.5 model's own fp32 forward fails on ``device``, or None where it runs.

    Transformers takes flash-linear-attention's fused Gated DeltaNet kernels where that
    package imports (the reference torch path otherwise), and their chunked rule asserts
    bf16/fp16 inputs: with them, fp32 comparisons of hybrids cannot run on CUDA at all. A
    tiny model's forward finds out (built without touching the tests' random state)."""
    if device == "cpu":
        return None
    import transformers

    with torch.random.fork_rng(devices=[]):
        config = transformers.Qwen3_5TextConfig(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
        model = transformers.Qwen3_5ForCausalLM(config).to(device)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]], device=device))
    except AssertionError as error:  # fla: "... does not support float32"
        return f"an fp32 Gated DeltaNet forward fails on {device}: {error}"
    return None


def skip_unless_fp32_gated_delta_runs(device: str) -> None:
    """Skip an fp32 hybrid test where the fused kernels refuse fp32 (their bf16 tests run)."""
    problem = fp32_gated_delta_problem(device)
    if problem is not None:
        pytest.skip(problem)
