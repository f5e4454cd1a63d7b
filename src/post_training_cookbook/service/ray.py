"""``RayModelService``: the trainer and ``num_generator_replicas`` generators as Ray actors.

The trainer is one actor, or the ``num_trainer_workers`` ranks of a sharded trainer
(``sharded.py``; started by ``ray_startup``): every trainer call goes to every rank, and rank
0's result is the answer.

The service runs in the driver (the training loop's process) and holds only actor handles; the
loops use it exactly as ``LocalModelService``. Started on a local, loopback-only Ray by
default (``ray_env.init_local_ray``), or on an existing cluster with ``ray_address``. Each
generator builds its own engine: the torch ``LocalEngine`` or vLLM (``VLLMEngine``).

Routing: ``routing.PrefixRouter`` sends a prompt to the replica that holds its longest known
prefix (so an episode's turns stay where their KV cache is), else to the least loaded one.

Weight publication, by ``weight_transport``: ``"object_store"``: trainer rank 0 returns its
merged weights in the engines' dtype; Ray stores them once and every generator reads them
there (shared memory on one node, object transfer across nodes); the driver never holds
them. ``"broadcast"``: rank 0 sends them tensor by tensor, as the trainer gathers them, over a
``torch.distributed`` group of its own with the generators (``weight_broadcast``: gloo on
CPU, NCCL between GPUs). ``"auto"``: broadcast for a sharded trainer, else the object store.
LoRA adapter-only sync (vLLM) always goes through the object store. The three sync types
behave as in ``LocalModelService`` (PIPELINE: the engines swap weights between two decode
steps, sequences in flight go on). A publication that does not finish within
``weight_sync_timeout_s`` raises ``WeightSyncTimeoutError`` naming the replicas that did not
confirm: at once for SYNCHRONOUS, at the next service call for the deferred types.

Failure: an actor that dies fails the calls waiting on it with ``WorkerDiedError``; the
service replaces no actor (``ray_failures.py``).

Over 400 lines: the service is one class whose calls share the failure and version
bookkeeping (fanning out to the trainer ranks added to it); the actors are in
``ray_actors``, their start in ``ray_startup``, the routing in ``routing``, how a failure is
told apart from its consequences in ``ray_failures``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from post_training_cookbook.engine.types import SampledSequence, SamplingParams, WeightsMode
from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.service.base import IdleClock, ModelService, PathLike
from post_training_cookbook.service.ray_actors import EngineSpec
from post_training_cookbook.service.ray_env import check_scale_dependencies
from post_training_cookbook.service.ray_failures import (
    WeightSyncTimeoutError,
    WorkerDiedError,
    first_failure,
    outcome,
)
from post_training_cookbook.service.ray_startup import (
    ActorLayout,
    Actors,
    start_actors,
    stop_actors,
)
from post_training_cookbook.service.routing import PrefixRouter
from post_training_cookbook.service.types import (
    VLLM_RECORDS_NO_ROUTES,
    GenerationEngine,
    PolicyState,
    WeightSyncType,
    WeightTransport,
)
from post_training_cookbook.trainer.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    TrainerSettings,
    TrainingSample,
)


class RayModelService(ModelService):
    def __init__(
        self,
        actors: Actors,
        *,
        engine_dtype: str,
        weight_sync_timeout_s: float,
        adapter_sync: bool = False,
        broadcast: bool = False,
    ) -> None:
        """Use ``create``."""
        self._actors = actors
        self._trainers = actors.trainers
        self._generators = actors.generators
        self._workers = actors.workers
        self._engine_dtype = engine_dtype
        self._adapter_sync = adapter_sync
        self._broadcast = broadcast
        self.weight_sync_timeout_s = weight_sync_timeout_s
        """Seconds a publication may take (settable between syncs)."""
        self._router = PrefixRouter(len(self._generators))
        self._trainer_version = 0
        self._target_version = 0
        self._applied = [0] * len(self._generators)
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
        num_trainer_workers: int = 1,
        collective_timeout_s: float = 600.0,
        weight_transport: WeightTransport = "auto",
        prefix_cache_bytes: int | None = None,
    ) -> RayModelService:
        """Start Ray (or join ``ray_address``), the trainer actor(s) (built as ``trainer``
        says; ``num_trainer_workers > 1``: the ranks of a sharded trainer, whose collectives
        wait ``collective_timeout_s`` at most) and the generators; return once every actor is
        up. ``lora_sync``: how LoRA weights reach the engines, ``"adapter"`` (the adapter
        alone; vLLM only, its LoRA kernels run the adapter) or ``"merged"`` (full merged
        weights); None picks ``"adapter"`` for vLLM. ``weight_transport``: see the module."""
        layout = ActorLayout(
            num_trainer_workers, num_generator_replicas, num_cpus_per_actor,
            num_gpus_per_trainer, num_gpus_per_generator,
        )  # fmt: skip
        if weight_sync_timeout_s <= 0 or collective_timeout_s <= 0:
            raise ValueError(
                "weight_sync_timeout_s and collective_timeout_s must be > 0, got "
                f"{weight_sync_timeout_s} and {collective_timeout_s}"
            )
        adapter_sync = syncs_adapter_alone(trainer, lora_sync, generation_engine)
        check_scale_dependencies(generation_engine)
        broadcast = not adapter_sync and layout.broadcasts(weight_transport, generation_engine)
        spec = EngineSpec(
            kind=generation_engine,
            source=info.source,
            dtype=engine_dtype or info.default_dtype,
            max_model_len=max_model_len,
            seed=trainer.seed or 0,
            vllm_options=dict(vllm_options or {}),
            max_lora_rank=trainer.lora_rank if adapter_sync else None,
            device="cuda" if num_gpus_per_generator > 0 else "cpu",
            prefix_cache_bytes=prefix_cache_bytes,
            record_routes=trainer.router_replay,
        )
        if spec.record_routes and spec.kind == "vllm":
            raise ValueError(VLLM_RECORDS_NO_ROUTES)
        actors = await start_actors(
            info.source, trainer, spec, layout, ray_address=ray_address,
            collective_timeout_s=collective_timeout_s, startup_timeout_s=startup_timeout_s,
            weight_group_timeout_s=weight_sync_timeout_s if broadcast else None,
        )  # fmt: skip
        return cls(
            actors, engine_dtype=spec.dtype, weight_sync_timeout_s=weight_sync_timeout_s,
            adapter_sync=adapter_sync, broadcast=broadcast,
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
                    self._slot(route.replica), generator.sample.remote(prompt_tokens, n, params)
                )
            completions = [sequence.tokens for sequence in sequences]
            return sequences
        finally:
            self._router.release(route, completions)

    def generator_idle_s(self) -> float:
        return self._idle.idle_s()

    # ---- training ----------------------------------------------------------------------

    async def forward(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        result: list[list[float]] = await self._on_trainers("forward", list(samples))
        return result

    async def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        result: ForwardBackwardResult = await self._on_trainers(
            "forward_backward", list(samples), loss
        )
        return result

    async def optim_step(self, learning_rate: float) -> OptimStepResult:
        self._raise_if_failed()
        result: OptimStepResult = await self._on_trainers("optim_step", learning_rate)
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
        # submitted before any later optim_step, so the trainer snapshots this version
        calls = self._submit_publication(version, mode)
        self._target_version = version
        publish = asyncio.create_task(self._publish(*calls, version, mode))
        if sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS:
            await publish
        else:
            self._publishing.add(publish)
            publish.add_done_callback(self._on_published)
        return version

    def _submit_publication(self, version: int, mode: WeightsMode) -> tuple[list[Any], list[Any]]:
        """The trainer ranks' calls that send the weights (or LoRA adapter) and each
        generator's that applies them: by broadcast, or through rank 0's object ref."""
        dtype = self._engine_dtype
        if self._broadcast:
            sends = [t.broadcast_weights.remote(dtype) for t in self._trainers]
            applies = [g.receive_weights.remote(version, mode) for g in self._generators]
            return sends, applies
        method = "lora_adapter" if self._adapter_sync else "inference_weights"
        sends = [getattr(t, method).remote(dtype) for t in self._trainers]
        if self._adapter_sync:
            applies = [g.apply_adapter.remote(sends[0], version) for g in self._generators]
        else:
            applies = [g.apply_weights.remote(sends[0], version, mode) for g in self._generators]
        return sends, applies

    async def _publish(
        self, sends: list[Any], applies: list[Any], version: int, mode: WeightsMode
    ) -> None:
        """Wait for the trainer ranks' sends and every generator's apply; a dead actor raises
        at once, a late generator after ``weight_sync_timeout_s``."""
        trainer_calls = [asyncio.ensure_future(self._call(r, s)) for r, s in enumerate(sends)]
        calls = {
            asyncio.ensure_future(self._call(self._slot(i), apply)): i
            for i, apply in enumerate(applies)
        }
        for call, replica in calls.items():  # counted when it lands, also after a timeout
            call.add_done_callback(functools.partial(self._landed_late, replica, version))
        await first_failure([*trainer_calls, *calls], timeout=self.weight_sync_timeout_s)
        late = sorted(replica for call, replica in calls.items() if not call.done())
        for call, replica in calls.items():
            if call.done():
                self._landed(replica, version)
        if late:
            raise WeightSyncTimeoutError(
                f"weight sync to version {version} ({mode}) did not finish within "
                f"{self.weight_sync_timeout_s}s on generator replica(s) {late}: "
                + "; ".join(self._describe(self._slot(i)) for i in late)
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
        await self._on_trainers("save_training_checkpoint", str(path))

    async def load_training_checkpoint(self, path: PathLike, *, load_optimizer: bool = True) -> int:
        version: int = await self._on_trainers(
            "load_training_checkpoint", str(path), load_optimizer
        )
        if version <= self._target_version:
            raise ValueError(
                f"the checkpoint's version {version} is not newer than the generators' "
                f"({self._target_version}); load it into a new service"
            )
        self._trainer_version = self._target_version = version
        await self._publish(*self._submit_publication(version, "drain"), version, "drain")
        return version

    async def save_inference_checkpoint(self, path: PathLike) -> None:
        await self._on_trainers("save_inference_checkpoint", str(Path(path)))

    # ---- introspection (tests, benchmarks) ---------------------------------------------

    @property
    def workers(self) -> list[dict[str, Any]]:
        """Each trainer rank, then each generator: pid, host, rank or replica and engine."""
        return [dict(worker) for worker in self._workers]

    @property
    def num_trainer_workers(self) -> int:
        return len(self._trainers)

    @property
    def weight_transport(self) -> str:
        """How full weights reach the generators: ``"broadcast"`` or ``"object_store"``."""
        return "broadcast" if self._broadcast else "object_store"

    @property
    def in_flight(self) -> list[int]:
        """Sequences being sampled on each replica now."""
        return list(self._router.in_flight)

    async def generator_stats(self) -> list[dict[str, float]]:
        stats: list[dict[str, float]] = await asyncio.gather(
            *(self._call(self._slot(i), g.stats.remote()) for i, g in enumerate(self._generators))
        )
        return stats

    async def score_on_generators(self, tokens: list[int]) -> list[list[float]]:
        """Each replica's logprobs of ``tokens`` laid out as ``forward``'s (vLLM engine only)."""
        scores: list[list[float]] = await asyncio.gather(
            *(
                self._call(self._slot(i), g.score.remote(tokens))
                for i, g in enumerate(self._generators)
            )
        )
        return scores

    # ---- plumbing ----------------------------------------------------------------------

    async def _on_trainers(self, method: str, *args: Any) -> Any:
        """``method`` on every trainer rank; rank 0's result. The first rank to fail (or
        die) raises at once."""
        if len(self._trainers) > 1:  # into the object store once, not once a rank
            import ray

            args = tuple(ray.put(arg) for arg in args)
        calls = [
            asyncio.ensure_future(self._call(rank, getattr(trainer, method).remote(*args)))
            for rank, trainer in enumerate(self._trainers)
        ]
        await first_failure(calls)
        return calls[0].result()

    def _slot(self, replica: int) -> int:
        """Generator replica ``replica``'s index among the workers (after the trainer ranks)."""
        return len(self._trainers) + replica

    async def _call(self, worker: int, ref: Any) -> Any:
        """Await a call on worker ``worker`` (trainer ranks first, then the generators); a
        dead actor raises at once."""
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as error:
            if worker >= len(self._trainers):
                self._router.exclude(worker - len(self._trainers))
            raise WorkerDiedError(
                f"{self._describe(worker)} died: {type(error).__name__}. The run cannot go on "
                "without it; restart it (resume=True continues from the last checkpoint)"
            ) from error
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    def _describe(self, worker: int) -> str:
        info = self._workers[worker]
        ranks = len(self._trainers)
        if worker >= ranks:
            name = f"generator replica {worker - ranks}"
        else:
            name = "trainer" if ranks == 1 else f"trainer rank {worker}"
        return f"{name} (pid {info['pid']} on {info['host']})"

    async def close(self) -> None:
        """Finalise every actor, then kill it: trainer ranks leave their process group (its
        threads end before the kill, ``Trainer.close``), generators close their engines. One
        that fails or takes over a minute is killed anyway."""
        await asyncio.gather(*self._publishing, return_exceptions=True)
        closing = [a.close.remote() for a in [*self._trainers, *self._generators]]
        await asyncio.wait([asyncio.ensure_future(outcome(c)) for c in closing], timeout=60)
        stop_actors(self._actors)


def syncs_adapter_alone(
    trainer: TrainerSettings,
    lora_sync: Literal["adapter", "merged"] | None,
    engine: GenerationEngine,
) -> bool:
    """Whether a LoRA trainer's weights reach the engines as the adapter alone (vLLM's LoRA
    slots) rather than merged: ``lora_sync``, by default the adapter for vLLM. ValueError
    where the adapter cannot carry them: another engine, or ``trainable_tokens``' rows."""
    if not trainer.use_lora or lora_sync == "merged":
        return False
    if lora_sync is None:
        return engine == "vllm" and not trainer.trainable_tokens
    if engine != "vllm":
        raise ValueError("lora_sync='adapter' needs generation_engine='vllm'")
    if trainer.trainable_tokens:
        raise ValueError(
            "lora_sync='adapter' sends vLLM the LoRA adapter alone, without trainable_tokens' "
            "rows: use lora_sync='merged'"
        )
    return True
