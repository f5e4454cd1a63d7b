"""Starting ``RayModelService``'s actors, and stopping them.

- **Trainer.** One actor, or with ``num_trainer_workers = N > 1`` the N ranks of a sharded
  trainer (``sharded.py``) in a placement group (one bundle a rank: its CPUs and GPUs;
  ``PACK``: on as few nodes as fit). Rank 0 names a free port on its node; every rank
  then joins the process group there (``init_process_group`` with the collective timeout)
  and loads its trainer.
- **Generators.** One actor a replica.
- **Weight publication** by broadcast (``weight_broadcast``): trainer rank 0 names another
  free port and serves the group's store there; rank 0 and every generator join it.

Anything that fails or does not finish within ``startup_timeout_s`` kills what was started
and raises one error that says what Ray had free. A placement group Ray cannot place yet
(its CPUs or GPUs held by other work) logs a warning every ``PLACEMENT_NOTICE_S`` meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from post_training_cookbook.service.ray_actors import EngineSpec, GeneratorWorker, TrainerWorker
from post_training_cookbook.service.ray_env import connect_ray, init_local_ray
from post_training_cookbook.service.types import GenerationEngine, WeightTransport
from post_training_cookbook.trainer.types import TrainerSettings

log = logging.getLogger(__name__)

PLACEMENT_NOTICE_S = 30.0
"""How often a placement group that is not placed yet says so."""


@dataclass(frozen=True)
class ActorLayout:
    """How many actors of each kind, and what each reserves."""

    num_trainer_workers: int = 1
    num_generator_replicas: int = 1
    num_cpus_per_actor: float = 1.0
    num_gpus_per_trainer: float = 0.0
    num_gpus_per_generator: float = 0.0

    def __post_init__(self) -> None:
        if self.num_generator_replicas < 1 or self.num_trainer_workers < 1:
            raise ValueError(
                "num_generator_replicas and num_trainer_workers must be >= 1, got "
                f"{self.num_generator_replicas} and {self.num_trainer_workers}"
            )

    def broadcasts(self, transport: WeightTransport, engine: GenerationEngine) -> bool:
        """Whether full weights go by broadcast (``weight_transport``): vLLM engines on GPUs
        take them through the object store (vLLM's own weight-transfer API is not built
        here: docs/scale_out.md)."""
        if transport not in ("auto", "broadcast", "object_store"):
            raise ValueError(
                f"weight_transport must be auto, broadcast or object_store: {transport}"
            )
        vllm_on_gpus = engine == "vllm" and self.num_gpus_per_generator > 0
        if transport == "broadcast" and vllm_on_gpus:
            raise ValueError("weight_transport='broadcast' reaches vLLM engines on CPU only")
        if transport == "auto":
            return self.num_trainer_workers > 1 and not vllm_on_gpus
        return transport == "broadcast"

    @property
    def weight_device(self) -> str:
        """Where broadcast weights travel: NCCL between GPUs, else gloo through the CPU."""
        on_gpus = self.num_gpus_per_trainer > 0 and self.num_gpus_per_generator > 0
        return "cuda" if on_gpus else "cpu"


@dataclass
class Actors:
    trainers: list[Any]
    """Rank 0 first."""
    generators: list[Any]
    workers: list[dict[str, Any]]
    """pid, host (and rank, or replica and engine) of each trainer rank, then each generator."""
    placement: Any
    """The trainer ranks' placement group (None for one trainer actor)."""
    owns_ray: bool
    """This service started (or joined) Ray, and shuts it down at close."""


async def start_actors(
    source: str,
    settings: TrainerSettings,
    engine: EngineSpec,
    layout: ActorLayout,
    *,
    ray_address: str | None,
    collective_timeout_s: float,
    weight_group_timeout_s: float | None,
    startup_timeout_s: float,
) -> Actors:
    """Every actor up (and the weight group joined, unless ``weight_group_timeout_s`` is
    None), or a ``RuntimeError`` once they were all stopped again."""
    import ray

    count = layout.num_trainer_workers + layout.num_generator_replicas
    owns_ray = _ensure_ray(ray_address, layout.num_cpus_per_actor * count)
    actors = Actors([], [], [], None, owns_ray)
    try:
        await asyncio.wait_for(
            _start(actors, source, settings, engine, layout, collective_timeout_s,
                   weight_group_timeout_s),
            startup_timeout_s,
        )  # fmt: skip
        return actors
    except (TimeoutError, ray.exceptions.RayError) as error:
        resources = ray.available_resources()
        stop_actors(actors)
        reason = (
            f"not placed within {startup_timeout_s}s" if isinstance(error, TimeoutError) else error
        )
        raise RuntimeError(
            f"could not start {layout.num_trainer_workers} trainer and "
            f"{layout.num_generator_replicas} generator actor(s): {reason}. "
            f"Ray's free resources: {resources}"
        ) from error


async def _start(
    actors: Actors,
    source: str,
    settings: TrainerSettings,
    engine: EngineSpec,
    layout: ActorLayout,
    collective_timeout_s: float,
    weight_group_timeout_s: float | None,
) -> None:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ranks = layout.num_trainer_workers
    trainer = ray.remote(TrainerWorker)
    reserved = {"num_cpus": layout.num_cpus_per_actor, "num_gpus": layout.num_gpus_per_trainer}
    placed: list[dict[str, Any]] = [{}]  # one trainer: placed as any actor
    if ranks > 1:
        bundle = {"CPU": layout.num_cpus_per_actor}
        if layout.num_gpus_per_trainer > 0:
            bundle["GPU"] = layout.num_gpus_per_trainer
        actors.placement = placement_group([bundle] * ranks, strategy="PACK")
        await _placed(actors.placement, f"{ranks} trainer ranks ({bundle} each)")
        placed = [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(actors.placement, rank)}
            for rank in range(ranks)
        ]
    actors.trainers = [
        trainer.options(**reserved, **placed[rank]).remote(source, settings, rank, ranks)
        for rank in range(ranks)
    ]
    generator = ray.remote(GeneratorWorker).options(
        max_concurrency=10_000,
        num_cpus=layout.num_cpus_per_actor,
        num_gpus=layout.num_gpus_per_generator,
    )
    actors.generators = [generator.remote(engine, i) for i in range(layout.num_generator_replicas)]
    rank0 = actors.trainers[0]
    address = await rank0.serve_rendezvous.remote(collective_timeout_s) if ranks > 1 else None
    starting: list[Awaitable[dict[str, Any]]] = [
        t.start.remote(address, collective_timeout_s) for t in actors.trainers
    ]
    starting += [g.ready.remote() for g in actors.generators]
    actors.workers = list(await asyncio.gather(*starting))
    if weight_group_timeout_s is not None:
        size, device = 1 + len(actors.generators), layout.weight_device
        address = await rank0.serve_rendezvous.remote(weight_group_timeout_s)
        await asyncio.gather(
            rank0.open_weight_group.remote(address, size, weight_group_timeout_s, device),
            *(
                g.open_weight_group.remote(address, 1 + i, size, weight_group_timeout_s, device)
                for i, g in enumerate(actors.generators)
            ),
        )


async def _placed(placement: Any, what: str) -> None:
    """Wait for Ray to place ``placement``, saying so while it cannot."""
    import ray

    ready = asyncio.wrap_future(placement.ready().future())
    waited = 0.0
    while True:
        done, _ = await asyncio.wait({ready}, timeout=PLACEMENT_NOTICE_S)
        if done:
            ready.result()
            return
        waited += PLACEMENT_NOTICE_S
        log.warning(
            "Ray has not placed %s after %.0fs; free now: %s",
            what, waited, ray.available_resources(),
        )  # fmt: skip


def stop_actors(actors: Actors) -> None:
    """Kill every actor, remove the placement group, and shut Ray down if this started it."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in [*actors.trainers, *actors.generators]:
        ray.kill(actor)
    if actors.placement is not None:
        remove_placement_group(actors.placement)
    if actors.owns_ray:
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
