"""The trainer: one causal LM (full weight or LoRA), its objective and one AdamW step.

Below the service layer: ``service/`` puts a trainer behind ``ModelService`` (in this process
or as Ray actors); the trainer knows nothing of generators or weight sync. Modules:
``trainer`` (``Trainer(model, settings)``: forward_backward, optim_step, checkpoints),
``logprobs`` (token log-probabilities of micro-batches), ``objective`` (a GRPO step's
objective: group advantages, the policy-gradient loss and its variants, SFT's loss; its old
path ``losses`` warns), ``precision`` (bf16 weights with fp32 masters), ``attention`` (the
CPU attention choice), ``packing`` and ``packed_layout`` (micro-batches as token streams,
shared prefixes once), ``scoring`` (a model that scores tokens, forward only: a local
teacher, the server's prompt scorer), ``memory_plan`` (micro-batch size and checkpointing
from free memory), ``checkpoints``, ``sharded`` and ``sharded_checkpoints`` (FSDP2 ranks
and their DCP checkpoints). The records (``types``: ``TrainerSettings`` in, results out)
import without torch; ``Trainer`` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from post_training_cookbook.lazy import module_getattr
from post_training_cookbook.trainer.types import (
    LOSS_TYPES,
    ForwardBackwardResult,
    LossConfig,
    LossType,
    OptimStepResult,
    Precision,
    RouterCounts,
    TrainerSettings,
    TrainingSample,
)

if TYPE_CHECKING:
    from post_training_cookbook.trainer.trainer import Trainer

__all__ = [
    "LOSS_TYPES",
    "ForwardBackwardResult",
    "LossConfig",
    "LossType",
    "OptimStepResult",
    "Precision",
    "RouterCounts",
    "Trainer",
    "TrainerSettings",
    "TrainingSample",
]

__getattr__ = module_getattr(__name__, lazy={"Trainer": "post_training_cookbook.trainer.trainer"})
