"""The model catalog, the bundled model, and where weights come from (see ``catalog``)."""

from post_training_cookbook.deprecation import moved_name
from post_training_cookbook.models.availability import WeightsSource, require_weights
from post_training_cookbook.models.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID
from post_training_cookbook.models.catalog import (
    CATALOG,
    ModelInfo,
    check_codec_options,
    check_model_can_sample,
    default_engine,
    list_models,
    require_engine_support,
    require_generator_support,
    resolve_model,
)

__all__ = [
    "BUNDLED_MODEL_DIR",
    "BUNDLED_MODEL_ID",
    "CATALOG",
    "ModelInfo",
    "WeightsSource",
    "check_codec_options",
    "check_model_can_sample",
    "default_engine",
    "list_models",
    "require_engine_support",
    "require_generator_support",
    "require_weights",
    "resolve_model",
]


def __getattr__(name: str) -> object:
    if name == "infer_codec_name":  # moved to the codecs, which own their formats
        return moved_name(__name__, name, "post_training_cookbook.codecs.inference")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
