"""The bundled tool-use model: weights, tokenizer and card ship in this folder."""

from pathlib import Path

BUNDLED_MODEL_ID = "post-training-cookbook/tool-use-tiny"
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "tool_use_tiny"
