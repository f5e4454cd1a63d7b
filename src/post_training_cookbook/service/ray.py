"""``RayModelService``: the trainer and ``num_generator_replicas`` generators as Ray actors.

The service runs in the driver (the training loop's process) and holds only actor handles; the
loops use it exactly as ``LocalModelService``. Started on a local, loopback-only Ray by
default (``ray_env.init_local_ray``), or on an existing cluster with ``ray_address``. Each
generator builds its own engine: the torch ``LocalEngine`` or vLLM (``VLLMEngine``).

Routing: ``routing.PrefixRouter`` sends a prompt to the replica that holds its longest known
prefix (so an episode's turns stay where their KV cache is), else to the least loaded one.

Weight publication (CPU path): the trainer actor returns its merged weights in the engines'
dtype; Ray stores them once in the object store and every generator reads them from there
(shared memory on one node, object transfer across nodes); the driver never holds them. The
three sync types behave as in ``LocalModelService`` (PIPELINE: the engines swap weights
between two decode steps, sequences in flight go on). A publication that does not finish
within ``weight_sync_timeout_s`` raises ``WeightSyncTimeoutError`` naming the replicas that did
not confirm: at once for SYNCHRONOUS, at the next service call for the deferred types. For
GPUs, see docs/scale_out.md (NCCL broadcast; not implemented here, no GPU to test it on).

Failure: an actor that dies (process killed, OOM, node lost) fails the calls waiting on it
with ``WorkerDiedError`` naming it — Ray reports the death, so nothing waits forever. The
service does not replace a dead replica: the run stops and resumes from its last checkpoint.

A little over 400 lines: the service is one class whose calls share the failure and version
bookkeeping; the actors are in ``ray_actors`` and the routing in ``routing``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, Literal

from post_training_cookbook.engine.types import SampledSequence, SamplingParams, WeightsMode
from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.service.base import IdleClock, ModelService, PathLike
from post_training_cookbook.service.factory import check_scale_dependencies
from post_training_cookbook.service.ray_actors import (
    EngineSpec,
    GeneratorWorker,
    TrainerWorker,
)
from post_training_cookbook.service.ray_env import connect_ray, init_local_ray
from post_training_cookbook.service.routing import PrefixRouter
from post_training_cookbook.service.types import (
    ForwardBackwardResult,
    GenerationEngine,
    LossConfig,
    OptimStepResult,
    PolicyState,
    TrainerSettings,
    TrainingSample,
    WeightSyncType,
)


class WorkerDiedError(RuntimeError):
    """A trainer or generator actor died; the message names it."""


class WeightSyncTimeoutError(TimeoutError):
    """A weights publication did not reach every generator in time."""


class RayModelService(ModelService):
    def __init__(
        self,
        trainer: Any,
        generators: list[Any],
        workers: list[dict[str, Any]],
        *,
        engine_dtype: str,
        weight_sync_timeout_s: float,
        owns_ray: bool,
        adapter_sync: bool = False,
    ) -> None:
        """Use ``create``; ``workers`` describes the trainer, then each generator."""
        self._trainer = trainer
        self._generators = generators
        self._workers = workers
        self._engine_dtype = engine_dtype
        self._adapter_sync = adapter_sync
        self.weight_sync_timeout_s = weight_sync_timeout_s
        """Seconds a publication may take (settable between syncs)."""
        self._owns_ray = owns_ray
        self._router = PrefixRouter(len(generators))
        self._trainer_version = 0
        self._target_version = 0
        self._applied = [0] * len(generators)
        self._publishing: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._idle = IdleClock()

    @classmethod
    async def create(
        cls,
        info: ModelInfo,
        trainer: TrainerSettings,
        *,
        num_generator_replicas: int = 1,
        generation_engine: GenerationEngine = "torch",
        engine_dtype: str | None = None,
        ray_address: str | None = None,
        weight_sync_timeout_s: float = 600.0,
        startup_timeout_s: float = 900.0,
        max_model_len: int | None = None,
        num_cpus_per_actor: float = 1.0,
        num_gpus_per_trainer: float = 0.0,
        num_gpus_per_generator: float = 0.0,
        lora_sync: Literal["adapter", "merged"] | None = None,
        vllm_options: dict[str, Any] | None = None,
    ) -> RayModelService:
        """Start Ray (or join ``ray_address``), the trainer actor (built as ``trainer`` says)
        and the generators; return once every actor is up. ``lora_sync``: how LoRA weights
        reach the engines, ``"adapter"`` (the adapter alone; vLLM only, its LoRA kernels run
        the adapter) or ``"merged"`` (full merged weights); None picks ``"adapter"`` for
        vLLM."""
        if num_generator_replicas < 1:
            raise ValueError(f"num_generator_replicas must be >= 1, got {num_generator_replicas}")
        if weight_sync_timeout_s <= 0:
            raise ValueError(f"weight_sync_timeout_s must be > 0, got {weight_sync_timeout_s}")
        check_scale_dependencies(generation_engine)
        adapter_sync = (
            trainer.use_lora and (lora_sync or _default_lora_sync(generation_engine)) == "adapter"
        )
        if adapter_sync and generation_engine != "vllm":
            raise ValueError("lora_sync='adapter' needs generation_engine='vllm'")
        spec = EngineSpec(
            kind=generation_engine,
            source=info.source,
            dtype=engine_dtype or info.default_dtype,
            max_model_len=max_model_len,
            seed=trainer.seed or 0,
            vllm_options=dict(vllm_options or {}),
            max_lora_rank=trainer.lora_rank if adapter_sync else None,
            device="cuda" if num_gpus_per_generator > 0 else "cpu",
        )
        import ray

        owns_ray = _ensure_ray(ray_address, num_cpus_per_actor * (1 + num_generator_replicas))
        trainer_actor = ray.remote(TrainerWorker).options(
            num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_trainer
        )
        generator = ray.remote(GeneratorWorker).options(
            max_concurrency=10_000, num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_generator
        )
        actors: list[Any] = [trainer_actor.remote(info.source, trainer)]
        actors += [generator.remote(spec, i) for i in range(num_generator_replicas)]
        workers = await _wait_ready(actors, startup_timeout_s, owns_ray)
        return cls(
            actors[0], actors[1:], workers, engine_dtype=spec.dtype,
            weight_sync_timeout_s=weight_sync_timeout_s, owns_ray=owns_ray,
            adapter_sync=adapter_sync,
        )  # fmt: skip

    # ---- sampling ----------------------------------------------------------------------

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        self._raise_if_failed()
        route = self._router.acquire(prompt_tokens, n)
        completions: list[list[int]] = []
        try:
            generator = self._generators[route.replica]
            with self._idle.busy():
                sequences: list[SampledSequence] = await self._call(
                    1 + route.replica, generator.sample.remote(prompt_tokens, n, params)
                )
            completions = [sequence.tokens for sequence in sequences]
            return sequences
        finally:
            self._router.release(route, completions)

    def generator_idle_s(self) -> float:
        return self._idle.idle_s()

    # ---- training ----------------------------------------------------------------------

    async def forward(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        result: list[list[float]] = await self._call(0, self._trainer.forward.remote(samples))
        return result

    async def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        result: ForwardBackwardResult = await self._call(
            0, self._trainer.forward_backward.remote(list(samples), loss)
        )
        return result

    async def optim_step(self, learning_rate: float) -> OptimStepResult:
        self._raise_if_failed()
        result: OptimStepResult = await self._call(
            0, self._trainer.optim_step.remote(learning_rate)
        )
        self._trainer_version = result.version
        return result

    # ---- weights -----------------------------------------------------------------------

    async def weights_sync(
        self, weight_sync_type: WeightSyncType = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    ) -> int:
        sync_type = WeightSyncType.parse(weight_sync_type)
        self._raise_if_failed()
        version = self._trainer_version
        if version <= self._target_version:
            return version  # already published (or being published)
        mode = sync_type.engine_mode
        if self._adapter_sync and mode == "pipeline":
            raise ValueError("PIPELINE needs full-weight training; LoRA adapters apply drained")
        # submitted before any later optim_step, so the trainer actor snapshots this version
        weights = self._snapshot()
        self._target_version = version
        publish = asyncio.create_task(self._publish(weights, version, mode))
        if sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS:
            await publish
        else:
            self._publishing.add(publish)
            publish.add_done_callback(self._on_published)
        return version

    def _snapshot(self) -> Any:
        """An object ref to the trainer's weights (or LoRA adapter) for the engines."""
        if self._adapter_sync:
            return self._trainer.lora_adapter.remote(self._engine_dtype)
        return self._trainer.inference_weights.remote(self._engine_dtype)

    def _apply_remote(self, generator: Any, weights: Any, version: int, mode: WeightsMode) -> Any:
        if self._adapter_sync:
            return generator.apply_adapter.remote(weights, version)
        return generator.apply_weights.remote(weights, version, mode)

    async def _publish(self, weights: Any, version: int, mode: WeightsMode) -> None:
        """Every generator reads ``weights`` (an object ref) from the object store."""
        calls = {
            asyncio.ensure_future(self._call(1 + i, self._apply_remote(g, weights, version, mode)))
            : i for i, g in enumerate(self._generators)
        }  # fmt: skip
        done, pending = await asyncio.wait(calls, timeout=self.weight_sync_timeout_s)
        for call in done:
            call.result()  # a dead replica raises here
            self._landed(calls[call], version)
        for call in pending:  # reported below; still counted if it lands later
            call.add_done_callback(functools.partial(self._landed_late, calls[call], version))
        if pending:
            late = sorted(calls[call] for call in pending)
            raise WeightSyncTimeoutError(
                f"weight sync to version {version} ({mode}) did not finish within "
                f"{self.weight_sync_timeout_s}s on generator replica(s) {late}: "
                + "; ".join(self._describe(1 + i) for i in late)
            )

    def _landed(self, replica: int, version: int) -> None:
        self._applied[replica] = max(self._applied[replica], version)

    def _landed_late(self, replica: int, version: int, call: asyncio.Future[Any]) -> None:
        if not call.cancelled() and call.exception() is None:
            self._landed(replica, version)

    def _on_published(self, task: asyncio.Task[None]) -> None:
        self._publishing.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def policy_state(self) -> PolicyState:
        applied = min(self._applied)
        return PolicyState(
            trainer_step=self._trainer_version,
            target_weights_version=self._target_version,
            applied_weights_version=applied,
            pending_publish=applied < self._target_version,
        )

    # ---- checkpoints -------------------------------------------------------------------

    async def save_training_checkpoint(self, path: PathLike) -> None:
        await self._call(0, self._trainer.save_training_checkpoint.remote(str(path)))

    async def load_training_checkpoint(self, path: PathLike, *, load_optimizer: bool = True) -> int:
        version: int = await self._call(
            0, self._trainer.load_training_checkpoint.remote(str(path), load_optimizer)
        )
        if version <= self._target_version:
            raise ValueError(
                f"the checkpoint's version {version} is not newer than the generators' "
                f"({self._target_version}); load it into a new service"
            )
        self._trainer_version = self._target_version = version
        await self._publish(self._snapshot(), version, "drain")
        return version

    async def save_inference_checkpoint(self, path: PathLike) -> None:
        await self._call(0, self._trainer.save_inference_checkpoint.remote(str(Path(path))))

    # ---- introspection (tests, benchmarks) ---------------------------------------------

    @property
    def workers(self) -> list[dict[str, Any]]:
        """The trainer, then each generator: pid, host, engine."""
        return [dict(worker) for worker in self._workers]

    @property
    def in_flight(self) -> list[int]:
        """Sequences being sampled on each replica now."""
        return list(self._router.in_flight)

    async def generator_stats(self) -> list[dict[str, float]]:
        stats: list[dict[str, float]] = await asyncio.gather(
            *(self._call(1 + i, g.stats.remote()) for i, g in enumerate(self._generators))
        )
        return stats

    async def score_on_generators(self, tokens: list[int]) -> list[list[float]]:
        """Each replica's logprobs of ``tokens`` laid out as ``forward``'s (vLLM engine only)."""
        scores: list[list[float]] = await asyncio.gather(
            *(self._call(1 + i, g.score.remote(tokens)) for i, g in enumerate(self._generators))
        )
        return scores

    # ---- plumbing ----------------------------------------------------------------------

    async def _call(self, worker: int, ref: Any) -> Any:
        """Await a call on worker ``worker`` (0 = trainer); a dead actor raises at once."""
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as error:
            if worker > 0:
                self._router.exclude(worker - 1)
            raise WorkerDiedError(
                f"{self._describe(worker)} died: {type(error).__name__}. The run cannot go on "
                "without it; restart it (resume=True continues from the last checkpoint)"
            ) from error
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    def _describe(self, worker: int) -> str:
        info = self._workers[worker]
        name = "trainer" if worker == 0 else f"generator replica {worker - 1}"
        return f"{name} (pid {info['pid']} on {info['host']})"

    async def close(self) -> None:
        import ray

        await asyncio.gather(*self._publishing, return_exceptions=True)
        closing = [g.close.remote() for g in self._generators]
        await asyncio.wait([asyncio.ensure_future(_awaited(c)) for c in closing], timeout=60)
        for actor in [self._trainer, *self._generators]:
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()


def _ensure_ray(address: str | None, cpus_needed: float) -> bool:
    """Start a local loopback-only Ray, or join ``address``, unless Ray is up; True when this
    call started or joined it (the service then shuts it down at close)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        init_local_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(cpus_needed)))
    else:
        connect_ray(address)
    return True


def _default_lora_sync(engine: GenerationEngine) -> Literal["adapter", "merged"]:
    return "adapter" if engine == "vllm" else "merged"


async def _awaited(ref: Awaitable[Any]) -> Any:
    try:
        return await ref
    except Exception as error:  # closing: a dead or failing actor is killed anyway
        return error


async def _wait_ready(actors: list[Any], timeout_s: float, owns_ray: bool) -> list[dict[str, Any]]:
    """Every actor's ``ready()``; a clear error (and no leftover actors) when one cannot start."""
    import ray

    try:
        workers: list[dict[str, Any]] = await asyncio.wait_for(
            asyncio.gather(*(actor.ready.remote() for actor in actors)), timeout_s
        )
        return workers
    except (TimeoutError, ray.exceptions.RayError) as error:
        resources = ray.available_resources()
        for actor in actors:
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()
        reason = f"not placed within {timeout_s}s" if isinstance(error, TimeoutError) else error
        raise RuntimeError(
            f"could not start the trainer and {len(actors) - 1} generator actor(s): {reason}. "
            f"Ray's free resources: {resources}"
        ) from error
