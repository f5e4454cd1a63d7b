"""The devices tests run on: the CPU always, CUDA where present (``scripts/gpu_check.sh`` runs
the CUDA cases, marked ``cuda``, on a GPU machine)."""

from __future__ import annotations

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
