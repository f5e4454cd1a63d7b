"""The service layer: a trainer and generators behind one interface (``ModelService``).

``factory.open_service`` builds one from a ``ServiceSpec``. The trainer itself, its records
(``TrainingSample``, ``LossConfig``, ``TrainerSettings``, results) and its losses live one
floor down, in ``trainer/``. The interface and the factory import without torch;
``LocalModelService`` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from post_training_cookbook.lazy import module_getattr
from post_training_cookbook.service.base import ModelService
from post_training_cookbook.service.factory import ServiceSpec, open_service
from post_training_cookbook.service.types import PolicyState, WeightSyncType

if TYPE_CHECKING:
    from post_training_cookbook.service.local import LocalModelService

_MOVED_TO_TRAINER = {
    "ForwardBackwardResult": "post_training_cookbook.trainer.types",
    "LossConfig": "post_training_cookbook.trainer.types",
    "OptimStepResult": "post_training_cookbook.trainer.types",
    "TrainerSettings": "post_training_cookbook.trainer.types",
    "TrainingSample": "post_training_cookbook.trainer.types",
    "Trainer": "post_training_cookbook.trainer.trainer",
}

__all__ = [
    "LocalModelService",
    "ModelService",
    "PolicyState",
    "ServiceSpec",
    "WeightSyncType",
    "open_service",
]

__getattr__ = module_getattr(
    __name__,
    lazy={"LocalModelService": "post_training_cookbook.service.local"},
    moved=_MOVED_TO_TRAINER,
)
