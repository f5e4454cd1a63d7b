"""Fixtures shared by the GRPO loop tests (``test_grpo_*``)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from test_grpo_common import build_tiny_model
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama + tool-use tokenizer folder, usable as ``GRPOConfig.model``."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_dir"))


@pytest.fixture(scope="session")
def tiny_llama_tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def torch_threads() -> Iterator[Callable[[int], None]]:
    """``torch.set_num_threads`` for the test; torch's count is restored after it (CI runs at
    1 thread, so thread tests raise it to see counts that differ)."""
    original = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(original)


# The scale-out tests' model and Ray cluster (test_scale_*.py), one per module that asks.
@pytest.fixture(scope="module")
def scale_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_scale_common import build_scale_model

    return build_scale_model(tmp_path_factory.mktemp("scale_model"))


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    import ray
    from test_scale_common import start_test_ray

    start_test_ray(tmp_path_factory.mktemp("ray_home"))
    yield
    ray.shutdown()


@pytest.fixture
def full_fp32() -> Iterator[None]:
    """CUDA matmuls and cuDNN convolutions in full fp32 for the test: cuDNN's default for
    fp32 convolutions is TF32 (a 10-bit mantissa, ~1e-3 relative), which would put a CUDA
    case of an fp32 comparison (1e-5) out of its bound on rounding alone. Nothing changes
    on a CPU."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(scope="module")
def bfcl_handler() -> Any:
    """BFCL's OpenAI FC handler, which its eval runner decodes recorded replies with."""
    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENAI_API_KEY", "unused-no-request-is-made")
        return OpenAICompletionsHandler("gpt-4o-2024-11-20", 0.001, "gpt-4o-2024-11-20-FC", True)


class RecordedSigterms:
    """A Python SIGTERM handler that counts the signals it gets."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1


@pytest.fixture
def handler_before() -> Iterator[RecordedSigterms]:
    """The process's SIGTERM handler before a test's training call: it counts the signals
    it gets, instead of ending pytest (the test process's own is put back afterwards)."""
    recorded = RecordedSigterms()
    original = signal.signal(signal.SIGTERM, recorded)
    yield recorded
    signal.signal(signal.SIGTERM, original)
