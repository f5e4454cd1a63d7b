"""Fixtures shared by the GRPO loop tests (``test_grpo_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_grpo_common import build_tiny_model
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama + tool-use tokenizer folder, usable as ``GRPOConfig.model``."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_dir"))


@pytest.fixture(scope="session")
def tiny_llama_tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)
