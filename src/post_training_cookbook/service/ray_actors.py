"""The Ray actors behind ``RayModelService``: one trainer, one per generator replica.

Plain classes, made actors with ``ray.remote(...)`` when the service starts, so this module
imports without Ray. The trainer actor is synchronous: Ray runs its calls one at a time in
the order they were submitted, so a weights snapshot asked for after ``optim_step`` sees that
step and no later one. Generator actors are asyncio actors: many ``sample`` calls run at once
and the engine batches them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from post_training_cookbook.engine.types import SampledSequence, SamplingParams, WeightsMode
from post_training_cookbook.service.trainer import ADAPTER_NAME, Trainer
from post_training_cookbook.service.types import (
    ForwardBackwardResult,
    GenerationEngine,
    LossConfig,
    OptimStepResult,
    TrainerSettings,
    TrainingSample,
)


def process_identity() -> dict[str, Any]:
    """This process, for error messages: pid and host."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


class TrainerWorker:
    def __init__(self, source: str, settings: TrainerSettings) -> None:
        self.trainer = Trainer.from_settings(source, settings)

    def ready(self) -> dict[str, Any]:
        return process_identity() | {"version": self.trainer.version}

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

    def inference_weights(self, dtype: str) -> dict[str, torch.Tensor]:
        """Merged weights in ``dtype``, each storage once: a tied ``lm_head`` is left out, the
        engines take it from the embedding."""
        seen: set[int] = set()
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in self.trainer.state_dict_for_inference().items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            weights[name] = tensor.to("cpu", getattr(torch, dtype)).contiguous()
        return weights

    def lora_adapter(self, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The LoRA adapter alone, as PEFT saves it: tensors and ``adapter_config.json``."""
        settings = self.trainer.lora_settings
        tensors = {
            name.replace(f".{ADAPTER_NAME}.", "."): p.detach().to("cpu", getattr(torch, dtype))
            for name, p in self.trainer.trainable_parameters().items()
        }
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
    vllm_options: dict[str, Any] = field(default_factory=dict)
    """Passed to ``vllm.EngineArgs`` as they are."""


class _Engine(Protocol):
    version: int

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]: ...

    def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, mode: WeightsMode = ...
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
            copy_model=False,
        )  # fmt: skip
    raise ValueError(f"generation engine must be 'torch' or 'vllm', got {spec.kind!r}")


class GeneratorWorker:
    def __init__(self, spec: EngineSpec, replica: int) -> None:
        self.spec = spec
        self.replica = replica
        self.engine: _Engine = build_engine(spec)
        self._update_lock = asyncio.Lock()
        self._requested_version = 0

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
        await self.engine.close()
