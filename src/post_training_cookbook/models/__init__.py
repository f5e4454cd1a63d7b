"""The model catalog and the bundled model (see ``catalog``)."""

from post_training_cookbook.models.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID
from post_training_cookbook.models.catalog import (
    CATALOG,
    ModelInfo,
    check_model_can_sample,
    list_models,
    require_generator_support,
    resolve_model,
)

__all__ = [
    "BUNDLED_MODEL_DIR",
    "BUNDLED_MODEL_ID",
    "CATALOG",
    "ModelInfo",
    "check_model_can_sample",
    "list_models",
    "require_generator_support",
    "resolve_model",
]
