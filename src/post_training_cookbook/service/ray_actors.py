"""The Ray actors behind ``RayModelService``: one per trainer rank, one per generator replica.

Plain classes, made actors with ``ray.remote(...)`` when the service starts, so this module
imports without Ray. Trainer actors are synchronous: Ray runs their calls one at a time in
the order they were submitted, so a weights snapshot asked for after ``optim_step`` sees that
step and no later one. With ``num_trainer_workers > 1`` every trainer call goes to every
rank (they run one sharded trainer, ``sharded.py``) and rank 0's result is the answer.
Generator actors are asyncio actors: many ``sample`` calls run at once and the engine
batches them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from post_training_cookbook.engine.types import SampledSequence, SamplingParams, WeightsMode
from post_training_cookbook.service.types import GenerationEngine
from post_training_cookbook.service.weight_broadcast import WeightGroup
from post_training_cookbook.trainer.sharded import (
    Rendezvous,
    TrainerGroup,
    full_tensor,
    serve_rendezvous,
)
from post_training_cookbook.trainer.trainer import ADAPTER_NAME, Trainer
from post_training_cookbook.trainer.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    TrainerSettings,
    TrainingSample,
)


def process_identity() -> dict[str, Any]:
    """This process, for error messages: pid and host."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def serve_rendezvous_here(timeout_s: float) -> Rendezvous:
    """A TCP store served on this node's address (``sharded.serve_rendezvous``)."""
    import ray

    return serve_rendezvous(ray.util.get_node_ip_address(), timeout_s)


class TrainerWorker:
    def __init__(
        self, source: str, settings: TrainerSettings, rank: int = 0, world_size: int = 1
    ) -> None:
        """Nothing loads yet: ``start`` builds the trainer (rank 0 first serves where the
        ranks meet, ``serve_rendezvous``)."""
        self.source, self.settings = source, settings
        self.rank, self.world_size = rank, world_size
        self.trainer: Trainer
        self._weight_group: WeightGroup | None = None
        self._rendezvous: list[Rendezvous] = []

    def serve_rendezvous(self, timeout_s: float) -> str:
        """Rank 0: serve a store for a group to meet at, for as long as this actor lives; its
        address (the port bound before anyone knows it)."""
        self._rendezvous.append(serve_rendezvous_here(timeout_s))
        return self._rendezvous[-1].address

    def start(self, address: str | None, timeout_s: float) -> dict[str, Any]:
        """Build the trainer; with several ranks, join them at ``address`` (rank 0's) first."""
        group = None
        if self.world_size > 1:
            assert address is not None, "a sharded trainer needs rank 0's address"
            group = TrainerGroup(self.rank, self.world_size, address, timeout_s)
        self.trainer = Trainer(self.source, self.settings, group=group)
        return self.ready()

    def ready(self) -> dict[str, Any]:
        return process_identity() | {"version": self.trainer.version, "rank": self.rank}

    def open_weight_group(self, address: str, size: int, timeout_s: float, device: str) -> None:
        """Rank 0: serve and join the weight-publication group (``weight_broadcast``)."""
        self._weight_group = WeightGroup(address, 0, size, timeout_s, device, serve=False)

    def broadcast_weights(self, dtype: str) -> int:
        """Send the merged weights in ``dtype`` to the generators (rank 0; the other ranks
        take part in the gathers); the bytes sent."""
        tensors = self.trainer.inference_tensors(getattr(torch, dtype))
        if self._weight_group is None:
            collections.deque(tensors, maxlen=0)
            return 0
        return self._weight_group.send((names[0], tensor) for names, tensor in tensors)

    def version(self) -> int:
        return self.trainer.version

    def forward(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        return self.trainer.forward(samples)

    def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        return self.trainer.forward_backward(samples, loss)

    def optim_step(self, learning_rate: float) -> OptimStepResult:
        return self.trainer.optim_step(learning_rate)

    def inference_weights(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """Merged weights in ``dtype``, each storage once: a tied ``lm_head`` is left out, the
        engines take it from the embedding (rank 0; the other ranks return None)."""
        tensors = self.trainer.inference_tensors(getattr(torch, dtype))
        if not self.trainer.is_main:
            collections.deque(tensors, maxlen=0)  # take part in the gathers only
            return None
        return {names[0]: tensor.to("cpu").contiguous() for names, tensor in tensors}

    def lora_adapter(self, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The LoRA adapter alone, as PEFT saves it: tensors and ``adapter_config.json``
        (rank 0; the other ranks take part in gathering it and return None)."""
        settings = self.trainer.lora_settings
        tensors = {
            name.replace(f".{ADAPTER_NAME}.", "."): full_tensor(p).to("cpu", getattr(torch, dtype))
            for name, p in self.trainer.trainable_parameters().items()
        }
        if not self.trainer.is_main:
            return None
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings["rank"],
            "lora_alpha": settings["alpha"], "lora_dropout": 0.0, "bias": "none",
            "target_modules": settings["target_modules"], "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        }  # fmt: skip
        return {name: t.contiguous() for name, t in tensors.items()}, config

    def save_training_checkpoint(self, path: str) -> None:
        self.trainer.save_training_checkpoint(path)

    def load_training_checkpoint(self, path: str, load_optimizer: bool) -> int:
        self.trainer.load_training_checkpoint(path, load_optimizer=load_optimizer)
        return self.trainer.version

    def save_inference_checkpoint(self, path: str) -> None:
        self.trainer.save_inference_checkpoint(Path(path))

    def close(self) -> None:
        """Leave the process group (every rank is asked at once) before the actor is killed,
        so its threads end here, not in a process torn down mid-way."""
        trainer: Trainer | None = getattr(self, "trainer", None)  # None: never started
        if trainer is not None:
            trainer.close()
        self._weight_group = None  # its gloo group's threads end with it
        self._rendezvous.clear()


@dataclass(frozen=True)
class EngineSpec:
    """How each generator builds its engine."""

    kind: GenerationEngine
    source: str
    """The model: a local folder (on every node) or a hub id."""
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    """vLLM only: the engine's context (None: the model's)."""
    max_batch_size: int = 64
    """torch engine only: live sequences per decode step."""
    device: str = "cpu"
    """torch engine only: ``"cuda"`` on an actor Ray gave a GPU (it sees that one alone)."""
    max_lora_rank: int | None = None
    """vLLM only: set for adapter-only LoRA sync (``GeneratorWorker.apply_adapter``)."""
    seed: int = 0
    prefix_cache_bytes: int | None = None
    """torch engine only: its prefix cache bound in bytes (None: a share of the device's)."""
    record_routes: bool = False
    """torch engine only: record the experts each token went to (router replay)."""
    vllm_options: dict[str, Any] = field(default_factory=dict)
    """Passed to ``vllm.EngineArgs`` as they are."""


class _Engine(Protocol):
    version: int

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]: ...

    def update_weights(
        self,
        weights: dict[str, torch.Tensor] | Iterator[tuple[str, torch.Tensor]],
        version: int,
        *,
        mode: WeightsMode = ...,
    ) -> None: ...

    async def wait_for_version(self, version: int) -> None: ...

    async def close(self) -> None: ...


def build_engine(spec: EngineSpec) -> Any:
    if spec.kind == "vllm":
        from post_training_cookbook.engine.vllm import VLLMEngine

        return VLLMEngine(
            spec.source, dtype=spec.dtype, max_model_len=spec.max_model_len, seed=spec.seed,
            max_lora_rank=spec.max_lora_rank, engine_options=spec.vllm_options,
        )  # fmt: skip
    if spec.kind == "torch":
        from transformers import AutoModelForCausalLM

        from post_training_cookbook.engine.local import LocalEngine

        dtype = getattr(torch, spec.dtype)
        model = AutoModelForCausalLM.from_pretrained(spec.source, dtype=dtype)
        return LocalEngine(
            model, dtype=dtype, device=spec.device, max_batch_size=spec.max_batch_size,
            copy_model=False, prefix_cache_bytes=spec.prefix_cache_bytes,
            record_routes=spec.record_routes,
        )  # fmt: skip
    raise ValueError(f"generation engine must be 'torch' or 'vllm', got {spec.kind!r}")


class GeneratorWorker:
    def __init__(self, spec: EngineSpec, replica: int) -> None:
        self.spec = spec
        self.replica = replica
        self.engine: _Engine = build_engine(spec)
        self._update_lock = asyncio.Lock()
        self._requested_version = 0
        self._weight_group: WeightGroup | None = None

    async def ready(self) -> dict[str, Any]:
        return process_identity() | {"replica": self.replica, "engine": self.spec.kind}

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        return await self.engine.sample(prompt_tokens, n, params)

    async def apply_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, mode: WeightsMode
    ) -> int:
        """Queue the weights (in version order: an older one arriving late is skipped) and
        return once ``version`` or newer samples."""
        async with self._update_lock:
            if version > self._requested_version:
                await asyncio.to_thread(self.engine.update_weights, state_dict, version, mode=mode)
                self._requested_version = version
        await self.engine.wait_for_version(version)
        return self.engine.version

    async def open_weight_group(
        self, address: str, rank: int, size: int, timeout_s: float, device: str
    ) -> None:
        """Join the weight-publication group (``weight_broadcast``) as ``rank``."""
        self._weight_group = await asyncio.to_thread(
            WeightGroup, address, rank, size, timeout_s, device
        )

    async def receive_weights(self, version: int, mode: WeightsMode) -> int:
        """``apply_weights`` for weights broadcast by the trainer: each tensor goes into the
        engine as it arrives. Every broadcast is received whole, in order, even one older
        than what the engine has (the trainer waits on every member)."""
        assert self._weight_group is not None, "open_weight_group first"
        async with self._update_lock:
            tensors = self._weight_group.receive()
            if version > self._requested_version:
                await asyncio.to_thread(self.engine.update_weights, tensors, version, mode=mode)
                self._requested_version = version
            else:
                await asyncio.to_thread(collections.deque, tensors, 0)
        await self.engine.wait_for_version(version)
        return self.engine.version

    async def apply_adapter(
        self, adapter: tuple[dict[str, torch.Tensor], dict[str, Any]], version: int
    ) -> int:
        """``apply_weights`` for a LoRA adapter alone (vLLM engine; drain)."""
        async with self._update_lock:
            if version > self._requested_version:
                tensors, config = adapter
                update = getattr(self.engine, "update_adapter", None)
                if update is None:
                    raise NotImplementedError(f"the {self.spec.kind} engine takes no adapters")
                await asyncio.to_thread(update, tensors, config, version)
                self._requested_version = version
        await self.engine.wait_for_version(version)
        return self.engine.version

    async def version(self) -> int:
        return self.engine.version

    async def score(self, tokens: list[int]) -> list[float]:
        score = getattr(self.engine, "score", None)
        if score is None:
            raise NotImplementedError(f"the {self.spec.kind} engine cannot score a sequence")
        result: list[float] = await score(tokens)
        return result

    async def stats(self) -> dict[str, float]:
        stats = getattr(self.engine, "stats", None)
        if stats is None:
            return {}
        snapshot = stats()
        to_metrics = getattr(snapshot, "to_metrics", None)
        return dict(to_metrics()) if to_metrics else dict(asdict(snapshot))

    async def close(self) -> None:
        self._weight_group = None  # its gloo group's threads end with it
        await self.engine.close()
