"""What ``evaluate`` scores: a catalog id, a local Hugging Face folder, or a GRPO run's weights
(``runs/models.py``, with a run's config.yaml read as a ``GRPOConfig``)."""

from __future__ import annotations

import os

from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.runs import models
from post_training_cookbook.runs.models import CHECKPOINT_MARKER, EvalModel, load_eval_weights

__all__ = ["CHECKPOINT_MARKER", "EvalModel", "load_eval_weights", "resolve_eval_model"]


def resolve_eval_model(
    model: str | os.PathLike[str], *, step: int | None = None, codec: str | None = None
) -> EvalModel:
    """Decide what to load from metadata alone; ``ValueError`` says what is wrong."""
    return models.resolve_eval_model(model, step=step, codec=codec, config_type=GRPOConfig)
