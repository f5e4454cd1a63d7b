"""What ``evaluate`` scores: a catalog id, a local Hugging Face folder, or a run's weights
(``runs/models.py``; a run's config.yaml read with the config class the caller hands in, by
default GRPO's, as the package's entry names it in ``runs/__init__.py``)."""

from post_training_cookbook.runs.models import (
    CHECKPOINT_MARKER,
    EvalModel,
    load_eval_weights,
    resolve_eval_model,
)

__all__ = ["CHECKPOINT_MARKER", "EvalModel", "load_eval_weights", "resolve_eval_model"]
