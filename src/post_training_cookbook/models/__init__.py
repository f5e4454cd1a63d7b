"""The model catalog, the bundled model, and where weights come from (see ``catalog``)."""

from post_training_cookbook.lazy import module_getattr
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


# moved to the codecs, which own their formats
__getattr__ = module_getattr(
    __name__, moved={"infer_codec_name": "post_training_cookbook.codecs.inference"}
)
