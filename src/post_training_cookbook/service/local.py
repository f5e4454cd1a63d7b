"""``LocalModelService``: the trainer and the generators in this process (CPU or CUDA).

The trainer holds fp32 master weights (LoRA via peft, or full weight). Each generator is a
``LocalEngine`` with its own inference copy. Trainer operations (and the copies of new
weights into the engines) run on one trainer thread, so the event loop — environments,
tools, sampling requests — keeps going while they compute, and one thread pool of OpenMP
workers serves all of them. Generators compute with half of torch's intra-op threads by
default, leaving the rest to the trainer beside them (see "Threads" in ``engine/local.py``);
the trainer takes ``trainer_threads`` (default: torch's count, which suits a loop where
training and generation take turns; a loop that runs them at once gives each its share).
Once built, the service releases the constructing thread's idle OpenMP pool
(``engine/threads.py``): from then on that thread hands its parallel work over. In lockstep
the trainer thread releases its own idle pool too, once a step's weights reach the engines:
the engines sample next while it waits.

Memory in lockstep (nothing sampling while the trainer steps): before ``forward_backward``
the engines free their KV buffers, cached prefixes and packed decode weights (re-packed at
their next decode step, as the weight update would anyway), and on a CPU the pages freed by the
step, and by a synchronous sync's staged weights, go back to the OS (``engine/heap.py``),
so that sampling and training, which allocate from different threads' malloc arenas, do
not hold both peaks at once.

Weight sync modes:
- SYNCHRONOUS: merged weights are handed to every engine, and the call returns once they
  sample with them (sequences in flight finish first under the old weights).
- BACKGROUND_PUBLISH: returns at once; engines finish what is in flight under the old
  version, then switch. Until then ``policy_state().pending_publish`` is true.
- PIPELINE: returns at once; engines switch between two decode steps, and sequences in
  flight go on under the new weights (their ``policy_segments`` record the switch).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ParamSpec, Protocol, TypeVar, cast

import torch
from transformers import PreTrainedModel

from post_training_cookbook.engine.heap import return_freed_memory
from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.threads import release_idle_openmp_pool, set_own_thread_count
from post_training_cookbook.engine.types import SampledSequence, SamplingParams, WeightsMode
from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.models.loading import load_model
from post_training_cookbook.service.base import IdleClock, ModelService, PathLike
from post_training_cookbook.service.types import (
    VLLM_RECORDS_NO_ROUTES,
    GenerationEngine,
    PolicyState,
    WeightSyncType,
)
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    TrainerSettings,
    TrainingSample,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _engine_weights(info: ModelInfo, trainer: Trainer, dtype: torch.dtype) -> PreTrainedModel:
    """An engine's own model: loaded in the engine's dtype on the trainer's device, holding
    the trainer's current (merged) weights, copied one weight at a time, so that no second
    full-precision copy of the model exists beside the trainer's."""
    model = load_model(info, dtype)
    cast(torch.nn.Module, model).to(trainer.device)  # PreTrainedModel.to is mistyped
    held = model.state_dict()
    with torch.no_grad():
        for names, tensor in trainer.inference_tensors(dtype):
            for name in names:
                held[name].copy_(tensor)
    return model


class Generator(Protocol):
    """What the service needs of an engine: ``LocalEngine`` and ``VLLMEngine`` both are."""

    @property
    def version(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]: ...

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, *, mode: WeightsMode
    ) -> None: ...

    async def wait_for_version(self, version: int) -> None: ...

    def release_memory(self) -> None: ...

    async def close(self) -> None: ...


def _vllm_engine(
    info: ModelInfo,
    trainer: Trainer,
    dtype: torch.dtype,
    options: Mapping[str, object] | None,
    max_model_length: int | None,
) -> Generator:
    """One in-process vLLM engine beside the trainer, on its device. vLLM loads the weights
    from ``info.source`` itself, in ``dtype``; they are the trainer's until its first step."""
    from post_training_cookbook.engine.vllm import VLLMEngine

    if trainer.device.type == "cuda":
        torch.cuda.set_device(trainer.device)  # vLLM takes the current CUDA device
    return VLLMEngine(
        info.source,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_length,
        seed=0,
        sleep_mode=trainer.device.type == "cuda",
        engine_options=dict(options or {}),
    )


def default_engine_threads() -> int:
    """Each generator's intra-op threads unless told: half of torch's count, at least 1."""
    return max(1, torch.get_num_threads() // 2)


class LocalModelService(ModelService):
    def __init__(
        self,
        info: ModelInfo,
        trainer: Trainer,
        *,
        num_generator_replicas: int = 1,
        engine_dtype: torch.dtype | None = None,
        max_batch_size: int = 64,
        engine_threads: int | None = None,
        trainer_threads: int | None = None,
        generation_engine: GenerationEngine = "torch",
        vllm_options: Mapping[str, object] | None = None,
        max_model_length: int | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        """Build it with ``create`` unless you already hold a ``Trainer``. The generators sit
        on the trainer's device. ``engine_threads``: each torch generator's intra-op threads
        (None: half of torch's count, at least 1); ``trainer_threads``: the trainer thread's
        (None: torch's count). ``generation_engine="vllm"``: one in-process vLLM engine
        (``vllm_options`` go to ``vllm.EngineArgs``; ``max_model_length`` sizes its KV cache),
        which frees its KV cache while the trainer steps where vLLM's sleep mode exists.
        ``prefix_cache_bytes``: each torch generator's prefix cache bound (``LocalEngine``)."""
        if generation_engine == "vllm" and num_generator_replicas != 1:
            raise ValueError("a local vLLM engine runs alone: num_generator_replicas must be 1")
        if generation_engine == "vllm" and trainer.router_replay:
            raise ValueError(VLLM_RECORDS_NO_ROUTES)
        if num_generator_replicas < 1:
            raise ValueError(f"num_generator_replicas must be >= 1, got {num_generator_replicas}")
        counts = {"engine_threads": engine_threads, "trainer_threads": trainer_threads}
        for name, count in counts.items():
            if count is not None and count < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {count}")
        self.info = info
        self.trainer = trainer
        dtype = engine_dtype or torch.float32
        self.engines: list[Generator]
        if generation_engine == "vllm":
            self.engines = [_vllm_engine(info, trainer, dtype, vllm_options, max_model_length)]
        else:
            threads = engine_threads or default_engine_threads()
            self.engines = [
                LocalEngine(
                    _engine_weights(info, trainer, dtype),
                    dtype=dtype,
                    device=trainer.device,
                    max_batch_size=max_batch_size,
                    version=trainer.version,
                    num_threads=threads,
                    copy_model=False,
                    prefix_cache_bytes=prefix_cache_bytes,
                    record_routes=trainer.router_replay,
                )
                for _ in range(num_generator_replicas)
            ]
        caller_threads = torch.get_num_threads()
        self._trainer_thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="trainer",
            initializer=set_own_thread_count,
            initargs=(trainer_threads,),
        )
        self.trainer_threads = self._trainer_thread.submit(torch.get_num_threads).result()
        if trainer_threads is not None:
            # torch.set_num_threads also set the default that threads starting later take;
            # only the trainer thread's own count was meant to change.
            torch.set_num_threads(caller_threads)
        if trainer.device.type == "cpu":
            release_idle_openmp_pool()
        self._in_flight = [0] * num_generator_replicas
        self._idle = IdleClock()
        self._target_version = trainer.version
        self._publishing: set[asyncio.Task[None]] = set()

    @classmethod
    def create(
        cls,
        info: ModelInfo,
        trainer: TrainerSettings,
        *,
        num_generator_replicas: int = 1,
        engine_dtype: torch.dtype | None = None,
        engine_threads: int | None = None,
        trainer_threads: int | None = None,
        generation_engine: GenerationEngine = "torch",
        vllm_options: Mapping[str, object] | None = None,
        max_model_length: int | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> LocalModelService:
        """Load ``info``'s weights into a trainer built as ``trainer`` says, and generators."""
        return cls(
            info,
            Trainer(info.source, trainer),
            num_generator_replicas=num_generator_replicas,
            engine_dtype=engine_dtype,
            engine_threads=engine_threads,
            trainer_threads=trainer_threads,
            generation_engine=generation_engine,
            vllm_options=vllm_options,
            max_model_length=max_model_length,
            prefix_cache_bytes=prefix_cache_bytes,
        )

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        replica = min(range(len(self.engines)), key=self._in_flight.__getitem__)
        self._in_flight[replica] += n
        try:
            with self._idle.busy():
                return await self.engines[replica].sample(prompt_tokens, n, params)
        finally:
            self._in_flight[replica] -= n

    def generator_idle_s(self) -> float:
        return self._idle.idle_s()

    async def forward(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        return await self._on_trainer(self.trainer.forward, samples)

    async def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        lockstep = not any(self._in_flight)  # nothing samples while the trainer steps
        if lockstep:
            for engine in self.engines:
                engine.release_memory()
        result = await self._on_trainer(self.trainer.forward_backward, samples, loss)
        if lockstep and self.trainer.device.type == "cpu":
            # What the step freed stays with the trainer thread's arena unless handed back,
            # and sampling, on its own thread, could not reuse it (engine/heap.py).
            return_freed_memory()
        return result

    async def optim_step(self, learning_rate: float) -> OptimStepResult:
        return await self._on_trainer(self.trainer.optim_step, learning_rate)

    async def weights_sync(
        self, weight_sync_type: WeightSyncType = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    ) -> int:
        sync_type = WeightSyncType.parse(weight_sync_type)
        version = self.trainer.version
        if version <= self._target_version:
            return version  # already published (or being published)
        # On the trainer thread, between optimizer steps: the engines get consistent weights,
        # and have them before the next training op, which queues behind this.
        await self._on_trainer(self._hand_weights_to_engines, version, sync_type.engine_mode)
        self._target_version = version
        applied = asyncio.create_task(self._until_applied(version))
        if sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS:
            await applied
            if self.trainer.device.type == "cpu":  # the staged copies, freed (engine/heap.py)
                return_freed_memory()
        else:
            self._publishing.add(applied)
            applied.add_done_callback(self._publishing.discard)
        return version

    def _hand_weights_to_engines(self, version: int, mode: WeightsMode) -> None:
        for engine in self.engines:
            # merged one weight at a time, in the engine's dtype: no whole extra copy
            tensors = self.trainer.inference_tensors(engine.dtype)
            engine.update_weights(((names[0], t) for names, t in tensors), version, mode=mode)
        if not any(self._in_flight) and self.trainer.device.type == "cpu":
            # Lockstep: the engines sample next while this thread waits, and its idle pool
            # would make every small op of theirs pay a wake-up (engine/threads.py).
            release_idle_openmp_pool()

    async def _until_applied(self, version: int) -> None:
        await asyncio.gather(*(engine.wait_for_version(version) for engine in self.engines))

    def _applied_version(self) -> int:
        return min(engine.version for engine in self.engines)

    def policy_state(self) -> PolicyState:
        applied = self._applied_version()
        return PolicyState(
            trainer_step=self.trainer.version,
            target_weights_version=self._target_version,
            applied_weights_version=applied,
            pending_publish=applied < self._target_version,
        )

    async def save_training_checkpoint(self, path: PathLike) -> None:
        await self._on_trainer(self.trainer.save_training_checkpoint, path)

    async def load_training_checkpoint(self, path: PathLike, *, load_optimizer: bool = True) -> int:
        await self._on_trainer(
            self.trainer.load_training_checkpoint, path, load_optimizer=load_optimizer
        )
        version = self.trainer.version
        if version == self._target_version == 0:
            return version  # no optimizer step yet: the checkpoint holds the base weights
        if version <= self._target_version:
            raise ValueError(
                f"the checkpoint's version {version} is not newer than the generators' "
                f"({self._target_version}); load it into a new service"
            )
        await self._on_trainer(self._hand_weights_to_engines, version, "drain")
        await self._until_applied(version)
        self._target_version = version
        return version

    async def save_inference_checkpoint(self, path: PathLike) -> None:
        await self._on_trainer(self.trainer.save_inference_checkpoint, Path(path))

    async def close(self) -> None:
        for publish in list(self._publishing):
            await publish
        await asyncio.gather(*(engine.close() for engine in self.engines))
        self._trainer_thread.shutdown()

    async def _on_trainer(
        self, function: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> _R:
        """``function(*args, **kwargs)`` on the trainer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._trainer_thread, functools.partial(function, *args, **kwargs)
        )
