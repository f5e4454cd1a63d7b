"""The service layer: a trainer and generators behind one interface (``ModelService``).

``factory.open_service`` builds one from a ``ServiceSpec``. The records (``types``) and the
factory import without torch; the implementations (``LocalModelService``, ``Trainer``) are
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from post_training_cookbook.service.base import ModelService
from post_training_cookbook.service.factory import ServiceSpec, open_service
from post_training_cookbook.service.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    PolicyState,
    TrainerSettings,
    TrainingSample,
    WeightSyncType,
)

if TYPE_CHECKING:
    from post_training_cookbook.service.local import LocalModelService
    from post_training_cookbook.service.trainer import Trainer

_LAZY = {
    "LocalModelService": "post_training_cookbook.service.local",
    "Trainer": "post_training_cookbook.service.trainer",
}

__all__ = [
    "ForwardBackwardResult",
    "LocalModelService",
    "LossConfig",
    "ModelService",
    "OptimStepResult",
    "PolicyState",
    "ServiceSpec",
    "Trainer",
    "TrainerSettings",
    "TrainingSample",
    "WeightSyncType",
    "open_service",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
