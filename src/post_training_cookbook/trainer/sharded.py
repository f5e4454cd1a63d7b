"""The sharded trainer: ``Trainer`` run on every rank of a process group, its model sharded
across the ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``).

There is one trainer implementation. Given a ``TrainerGroup``, ``Trainer`` joins the group
(``Shards``) before it loads the model, and shards the model once it is built (after peft for
LoRA); from then on it runs its usual step, and asks ``Shards`` at the few places where one
rank differs from one process:

- **Sharding.** ``fully_shard`` on every decoder layer, then on the root: the trainer's
  ``TokenLogprobs`` module, whose forward is the whole log-probability computation, so FSDP
  gathers the embeddings, final norm and LM head for it as it gathers each layer for the
  decoder. Frozen weights (the LoRA base) are sharded alike and get no gradients.
- **Batches.** Every rank is handed the whole batch and takes its share
  (``split_across_ranks``): samples balanced by tokens, then micro-batched as on one
  process; packed micro-batches (``packing.split_packed_across_ranks``) are balanced by
  the stream tokens each rank processes, a group's episodes kept together where they fit.
  FSDP's collectives run in every forward and backward, so every rank runs the same number
  of micro-batches: a rank short of work runs zero-weight ones (every mask 0).
- **Gradients.** Each micro-batch's loss is its share of the whole batch's loss
  (``objective.BatchTotals``, taken over the whole batch on every rank), so the gradients
  *summed* over ranks are the one-process gradients. FSDP averages across ranks by default;
  here its divide factor is 1, with sum-only collectives (gloo has no pre-scaled sum), and
  parameters a rank did not use reduce as zeros (mixture-of-experts routing differs by rank).
- **Clipping** takes the norm over every rank's shards (``precision.clip_gradients``).
- **Results.** The loss and metrics are summed across ranks; ``forward``'s rows gathered.
- **Weights out.** One FSDP group at a time is gathered whole, and its merged weights are
  yielded one tensor at a time on every rank (``inference_tensors``): rank 0 sends or saves
  them, the other ranks only take part in the gathers.
- **Checkpoints**: ``sharded_checkpoints`` (``torch.distributed.checkpoint``).
- **Timeouts.** The group is created with ``timeout_s``: joining it, and every collective
  after, raises instead of waiting longer for a rank that is gone.
- **Meeting.** The ranks meet at a TCP store (``TrainerGroup.address``). Whoever starts the
  ranks serves it first on a port the OS picks (``serve_rendezvous``) and hands out its
  address once bound: a port probed free, closed, and bound later by rank 0 can be taken by
  another process in between.
- **Closing** (``Shards.close``) ends the group's threads before it returns, not at exit.

Backends: gloo on CPU, NCCL on CUDA (each rank on the one GPU it sees).

The module passes 400 lines because every place a rank differs from one process, listed
above, is here, so that ``Trainer`` reads as one process everywhere else.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from post_training_cookbook.batching import length_groups
from post_training_cookbook.trainer import checkpoints
from post_training_cookbook.trainer.logprobs import MicroBatch, TokenLogprobs, collate
from post_training_cookbook.trainer.packing import collate_packed, split_packed_across_ranks
from post_training_cookbook.trainer.types import BatchSums, PackingMode, TrainingSample

log = logging.getLogger(__name__)

CLOSE_BARRIER_S = 30.0
"""How long a closing rank waits for the others to close too (gloo), before it leaves alone."""


@dataclass(frozen=True)
class TrainerGroup:
    """How one process joins a sharded trainer."""

    rank: int
    world_size: int
    address: str
    """``host:port`` of the rendezvous (the process group's TCP store)."""
    timeout_s: float = 600.0
    """Joining, and every collective after, raises once it has waited this long."""
    serve: bool = False
    """False: the store is served at ``address`` already (``serve_rendezvous``), every rank
    connects to it. True: rank 0 serves it when it joins, so the port must still be free
    then (a port fixed by the deployment)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def split_across_ranks(
    lengths: Sequence[int], world_size: int, max_tokens: int
) -> list[list[list[int]]]:
    """Each rank's micro-batches: lists of indices into ``lengths``, every rank with as many
    (``[]`` is a zero-weight micro-batch, padding).

    Samples go to ranks longest first, each to the rank with the fewest tokens so far (the
    lowest rank on a tie); each rank then groups its own as one process would
    (``batching.length_groups``). Deterministic, so every rank computes every rank's share.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += lengths[index]
    plans = []
    for share in shares:
        groups = length_groups([lengths[i] for i in share], max_tokens=max_tokens)
        plans.append([sorted(share[i] for i in group) for group in groups])
    count = max(1, *(len(plan) for plan in plans))
    return [plan + [[]] * (count - len(plan)) for plan in plans]


@dataclass(frozen=True)
class Rendezvous:
    """A TCP store being served, and where: the ranks meet there while this object lives."""

    store: dist.TCPStore
    address: str


def serve_rendezvous(host: str, timeout_s: float) -> Rendezvous:
    """Serve a store on ``host`` at a port the OS picks as it binds (port 0), so the port is
    held from before its address is known to anyone."""
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    return Rendezvous(store, f"{host}:{store.port}")


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float = 600.0
) -> None:
    """Run ``fn(rank, address, *args)`` in ``nprocs`` fresh processes (``mp.spawn``), the
    ranks of one group on this machine: ``address`` is a loopback store served here while they
    run (``TrainerGroup(rank, nprocs, address)``). Each rank closes its trainer itself."""
    rendezvous = serve_rendezvous("127.0.0.1", timeout_s)
    mp.spawn(fn, args=(rendezvous.address, *args), nprocs=nprocs)


def keep_on_loopback(address: str) -> None:
    """Gloo picks its network interface from the host name, which may resolve to another
    address than the rendezvous': with a loopback rendezvous (one node), pin gloo to ``lo``
    (unless ``GLOO_SOCKET_IFNAME`` is set already), so that no packet leaves loopback."""
    if address.rpartition(":")[0] in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards one by one: those of the classes the model names as not to be
    split (``_no_split_modules``: its decoder layers), innermost first."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules), so it "
            "cannot be sharded layer by layer"
        )
    return layers[::-1]


def full_tensor(tensor: Tensor) -> Tensor:
    """A sharded tensor gathered whole (a collective: every rank calls it); any other
    tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of ``model``'s parameters, their gradients and ``optimizer``'s state that this
    process holds (of sharded tensors, its own shards)."""

    def size(tensor: Tensor) -> int:
        held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return held.numel() * held.element_size()

    parameters = list(model.parameters())  # tied weights once
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "parameters": sum(size(p) for p in parameters),
        "gradients": sum(size(p.grad) for p in parameters if p.grad is not None),
        "optimizer": sum(size(v) for v in state),
    }


class Shards:
    """This process's place in a sharded trainer: its rank, the process group, and the
    sharded model's FSDP groups."""

    def __init__(self, group: TrainerGroup, device: torch.device) -> None:
        """Join the process group (every rank calls this; each waits up to the timeout)."""
        self.rank = group.rank
        self.world_size = group.world_size
        self.device = device
        self.timeout_s = group.timeout_s
        if device.type == "cuda":
            torch.cuda.set_device(device)
        keep_on_loopback(group.address)
        host, _, port = group.address.rpartition(":")
        timeout = datetime.timedelta(seconds=group.timeout_s)
        serves = group.serve and group.rank == 0
        store = dist.TCPStore(host, int(port), group.world_size, serves, timeout=timeout)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            self.backend, store=store, rank=group.rank, world_size=group.world_size,
            timeout=timeout,
        )  # fmt: skip
        self._root: FSDPModule | None = None
        self._groups: list[tuple[FSDPModule, list[str]]] = []

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------ sharding

    def shard(
        self,
        root: torch.nn.Module,
        model: torch.nn.Module,
        *,
        same_start: bool,
        frozen: TokenLogprobs | None = None,
    ) -> None:
        """Shard ``model`` (held by ``root``) layer by layer, then ``root`` with what is left;
        ``frozen`` (a frozen copy's module: the full-weight KL reference) the same way.
        ``same_start``: give every rank rank 0's trainable weights first (a LoRA adapter's
        random initialisation)."""
        if same_start:
            for parameter in model.parameters():
                if parameter.requires_grad:
                    dist.broadcast(parameter.data, src=0)
        keys = list(model.state_dict())
        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer)
        fully_shard(root)
        self._root = cast(FSDPModule, root)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a sum across ranks, not a mean
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self._root.set_reduce_scatter_unused_params(True)  # unused: zero, not missing
        self._groups = _groups_by_module(model, layers, self._root, keys)
        if frozen is not None:
            for layer in decoder_layers(frozen.model):
                fully_shard(layer)
            fully_shard(frozen)

    def reshard(self) -> None:
        """Back to shards only: FSDP keeps the root gathered after a forward, for the
        backward, which a no-grad forward never runs; an optimizer step in between would
        leave it stale."""
        if self._root is not None:
            self._root.reshard()

    # ------------------------------------------------------------ batches and results

    def micro_batches(
        self,
        samples: Sequence[TrainingSample],
        max_tokens: int,
        device: torch.device,
        packing: PackingMode = "off",
        shared_tokens: int | None = None,
    ) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the whole batch ``samples`` (packed ones with
        ``packing``: ``packing.split_packed_across_ranks``); padding ones hold one short row
        with every mask 0 and ``indices == []``."""
        if not samples:  # nothing to score, on every rank alike
            return
        if packing == "off":
            lengths = [len(sample.tokens) for sample in samples]
            plan = split_across_ranks(lengths, self.world_size, max_tokens)[self.rank]
        else:
            plans = split_packed_across_ranks(
                samples, self.world_size, max_tokens, packing, shared_tokens
            )
            plan = plans[self.rank]
        shortest = min(samples, key=lambda sample: len(sample.tokens)).tokens[:2]
        zeros = [0.0] * len(shortest)
        padding = TrainingSample(list(shortest), zeros, zeros, zeros)
        share = packing == "shared_prefix"
        for indices in plan:
            if indices:
                yield (
                    collate(samples, indices, device)
                    if packing == "off"
                    else collate_packed(samples, indices, device, share)
                )
            else:
                batch = (
                    collate([padding], [0], device)
                    if packing == "off"
                    else collate_packed([padding], [0], device, share)
                )
                batch.indices = []
                yield batch

    def agree(
        self, micro_batch_tokens: int, shared_stream_tokens: int, gradient_checkpointing: bool
    ) -> tuple[int, int, bool]:
        """The smallest micro-batch and stream bound of any rank's memory plan, and
        checkpointing if any rank's plan has it: every rank splits the batch alike
        (``split_across_ranks``)."""
        values = torch.tensor(
            [-micro_batch_tokens, -shared_stream_tokens, int(gradient_checkpointing)]
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return int(-values[0]), int(-values[1]), bool(values[2])

    def sum_results(self, sums: BatchSums) -> BatchSums:
        """Every rank's sums over its share of the batch, added up."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, sums)
        return sum(gathered, BatchSums())

    def gather_rows(self, rows: list[list[float]]) -> list[list[float]]:
        """Every rank's computed rows (the others are empty), on every rank."""
        self.reshard()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, {i: row for i, row in enumerate(rows) if row})
        merged = [list(row) for row in rows]
        for part in gathered:
            for index, row in part.items():
                merged[index] = row
        return merged

    # ------------------------------------------------------------ weights out

    @torch.no_grad()
    def inference_tensors(
        self, model: torch.nn.Module, adapter: str, dtype: torch.dtype | None
    ) -> Iterator[tuple[list[str], Tensor]]:
        """``checkpoints.inference_tensors`` of the sharded ``model``, on every rank: one FSDP
        group gathered at a time (the root's, then each layer's), so that no rank holds more
        than one layer's full weights beside its shards. Every rank must run it to the end."""
        self.reshard()
        for module, keys in self._groups:
            module.unshard()
            try:
                entries = [(key, _attribute(model, key)) for key in keys]
                yield from checkpoints.inference_tensors(model, adapter, dtype, entries=entries)
            finally:
                module.reshard()

    def close(self) -> None:
        """Leave the group, every rank together, and end its threads before returning (call
        it once nothing holds the sharded model: ``Trainer.close``).

        Destroying a process group does not stop gloo's worker and I/O threads, nor rank 0's
        store server, while anything still holds the group, and FSDP's state on the model
        and DTensor's sharding caches do. Left running into interpreter exit, a gloo worker
        thread that drops its last finished work there frees a Python object (the work's
        saved thread-local state), takes the GIL, and is ended by the finalizing interpreter
        (``pthread_exit``) inside a C++ destructor: SIGABRT, "terminate called without an
        active exception", about one spawned rank set in 150 (a core's backtrace). A
        barrier first, so that no rank closes its connections while another still uses
        them."""
        if not dist.is_initialized():
            return
        try:
            self._barrier()
        except RuntimeError as error:  # a rank gone or stuck: leave alone
            log.warning("sharded trainer rank %d closes without the others: %s", self.rank, error)
        finally:
            dist.destroy_process_group()
            self._root, self._groups = None, []
            _release_device_meshes()

    def _barrier(self) -> None:
        if self.backend == "gloo":  # bounded: a rank that never closes is named, not waited on
            seconds = min(self.timeout_s, CLOSE_BARRIER_S)
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds))
        else:
            dist.barrier()


def _release_device_meshes() -> None:
    """Drop the process groups every device mesh holds: DTensor's caches (sharding rules,
    redistribution plans, mesh topology) keep meshes alive for the life of the process, and a
    mesh holds its groups."""
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    gc.collect()  # FSDP's hooks hold the model in reference cycles
    # type(), not isinstance: some torch objects warn when asked their __class__
    for mesh in (o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)):
        mesh._pg_registry.clear()


def _groups_by_module(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    root: FSDPModule,
    keys: list[str],
) -> list[tuple[FSDPModule, list[str]]]:
    """``model``'s state-dict keys by the FSDP group that holds them: the root's first, then
    each layer's in model order."""
    paths = {id(module): name for name, module in model.named_modules()}
    layer_paths = sorted(((paths[id(layer)], layer) for layer in layers), key=lambda p: -len(p[0]))
    owned: dict[int, list[str]] = {id(root): []}
    for key in keys:
        owner: Any = next(
            (layer for path, layer in layer_paths if key.startswith(path + ".")), root
        )
        owned.setdefault(id(owner), []).append(key)
    first_key = {owner: keys.index(held[0]) for owner, held in owned.items() if held}
    modules = {id(module): module for module in [root, *layers]}
    order = [id(root), *sorted((o for o in first_key if o != id(root)), key=lambda o: first_key[o])]
    return [(cast(FSDPModule, modules[o]), owned[o]) for o in order if owned.get(o)]


def _attribute(model: torch.nn.Module, key: str) -> Tensor:
    """The tensor a state-dict key names, as the module holds it now (gathered, after
    ``unshard``)."""
    owner, _, leaf = key.rpartition(".")
    return cast(Tensor, getattr(model.get_submodule(owner) if owner else model, leaf))
