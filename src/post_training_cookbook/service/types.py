"""Records that cross the service edge beyond the trainer's own (``trainer/types.py``): where
the service runs, how weights reach the generators, the policy's version state, vLLM options.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from post_training_cookbook.engine.types import WeightsMode
from post_training_cookbook.lazy import module_getattr

Backend = Literal["local", "ray"]
"""Where the trainer and generators run: in this process, or as Ray actors."""
GenerationEngine = Literal["torch", "vllm"]
"""The generators' sampling engine: ``LocalEngine`` or vLLM."""
WeightTransport = Literal["auto", "broadcast", "object_store"]
"""How a Ray service's trainer sends full weights to its generators: a ``torch.distributed``
broadcast, or Ray's object store; ``"auto"``: broadcast from a sharded trainer."""
VLLM_RECORDS_NO_ROUTES = (
    'router_replay needs the experts each sampled token went to; generation_engine="vllm" '
    "does not return them through this package's vLLM engine (vLLM's "
    "enable_return_routed_experts is not wired in yet): sample with "
    'generation_engine="torch", or set router_replay=False'
)
"""Router replay with vLLM: refused before any model loads (``ServiceSpec``, ``GRPOConfig``)."""


@dataclass(frozen=True)
class PolicyState:
    trainer_step: int
    """Version produced by the last completed optimizer step."""
    target_weights_version: int
    """Version promised by the latest weight sync (queued in the deferred modes)."""
    applied_weights_version: int
    """Version the generators actually sample with."""
    pending_publish: bool


class WeightSyncType(enum.Enum):
    """How new weights reach the generators after an optimizer step."""

    WEIGHT_SYNC_TYPE_SYNCHRONOUS = "synchronous"
    """Publish inline; the next sample is on-policy."""
    WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH = "background_publish"
    """Publish from a background worker and return at once."""
    WEIGHT_SYNC_TYPE_PIPELINE = "pipeline"
    """Deferred, and generation in flight continues under the new weights."""

    @classmethod
    def parse(cls, value: WeightSyncType | str) -> WeightSyncType:
        """Accept a member, its name (``"WEIGHT_SYNC_TYPE_PIPELINE"``) or its short name
        (``"pipeline"``, case-insensitive)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value in cls.__members__:
                return cls[value]
            for member in cls:
                if member.value == value.lower():
                    return member
        names = ", ".join(f"{m.name} / {m.value!r}" for m in cls)
        raise ValueError(f"unknown weight sync type {value!r}; expected one of {names}")

    @property
    def engine_mode(self) -> WeightsMode:
        """How the engines apply weights published this way: PIPELINE swaps them between two
        decode steps; the other types let the sequences in flight finish first."""
        return "pipeline" if self is WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE else "drain"


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine options a run sets (``vllm.EngineArgs`` of the same names)."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    """None: vLLM's default (0.9), or 0.5 beside the trainer on one GPU."""
    max_num_seqs: int | None = None
    enforce_eager: bool = True

    def engine_options(self, *, beside_trainer: bool) -> dict[str, object]:
        """The options to hand vLLM; unset ones are left to vLLM."""
        memory = self.gpu_memory_utilization
        if memory is None and beside_trainer:
            memory = 0.5
        options: dict[str, object] = {"enforce_eager": self.enforce_eager}
        if self.tensor_parallel_size > 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        if memory is not None:
            options["gpu_memory_utilization"] = memory
        if self.max_num_seqs is not None:
            options["max_num_seqs"] = self.max_num_seqs
        return options


_MOVED_TO_TRAINER = frozenset(
    {
        "ForwardBackwardResult",
        "LOSS_TYPES",
        "LossConfig",
        "LossType",
        "OptimStepResult",
        "Precision",
        "TrainerSettings",
        "TrainingSample",
    }
)
__getattr__ = module_getattr(
    __name__, moved=dict.fromkeys(_MOVED_TO_TRAINER, "post_training_cookbook.trainer.types")
)
