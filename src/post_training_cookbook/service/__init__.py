"""The service layer: a trainer and generators behind one interface (``ModelService``)."""

from post_training_cookbook.service.base import ModelService
from post_training_cookbook.service.local import LocalModelService
from post_training_cookbook.service.trainer import Trainer
from post_training_cookbook.service.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    PolicyState,
    TrainingSample,
    WeightSyncType,
)

__all__ = [
    "ForwardBackwardResult",
    "LocalModelService",
    "LossConfig",
    "ModelService",
    "OptimStepResult",
    "PolicyState",
    "Trainer",
    "TrainingSample",
    "WeightSyncType",
]
