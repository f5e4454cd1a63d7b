"""Weights from the trainer to the generators by ``torch.distributed`` broadcast.

A process group of its own, apart from the sharded trainer's: the trainer's rank 0 is rank 0
here, generator replica ``i`` is rank ``1 + i``. The service creates it once, when it starts
(``WeightGroup``: a TCP store served by the trainer's rank 0, then a gloo group on CPU or an
NCCL one on CUDA). Each publication sends the merged weights one tensor at a time, in the
engines' dtype, as the trainer gathers them: a header (names, shape, dtype), then the
tensor; an empty header ends it. The generators copy each into their engine as it comes
(``LocalEngine.update_weights`` takes (name, tensor) pairs), so no side holds a second whole
model.

Every operation waits at most ``timeout_s``: a generator that is gone makes the trainer's
broadcast raise, and a trainer that is gone makes the generators' receive raise. A group
that timed out is left broken (its peers may be mid-tensor); the run stops, and a resumed
run builds a new one.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from post_training_cookbook.trainer.sharded import keep_on_loopback


class WeightGroup:
    """This process's membership of the weight-publication group."""

    def __init__(
        self,
        address: str,
        rank: int,
        size: int,
        timeout_s: float,
        device: str = "cpu",
        serve: bool = True,
    ) -> None:
        """Join the group at its store, ``address`` (``host:port``), served by rank 0 as it
        joins, or already (``serve=False``: ``sharded.serve_rendezvous``); returns once all
        ``size`` members joined, or raises after ``timeout_s``."""
        host, _, port = address.rpartition(":")
        keep_on_loopback(address)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.device = torch.device(device)
        serves = serve and rank == 0
        self._store = dist.TCPStore(host, int(port), size, serves, timeout=timeout)
        store = dist.PrefixStore("weights", self._store)
        self._group: Any  # a c10d backend (its stubs lack broadcast, which it has)
        if self.device.type == "cuda":  # untested here: no GPU (docs/scale_out.md)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, size, timeout)

    def send(self, tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Broadcast ``tensors`` (rank 0); the bytes sent."""
        sent = 0
        for name, tensor in tensors:
            payload = tensor.detach().to(self.device).contiguous()
            self._send_header((name, tuple(payload.shape), payload.dtype))
            self._broadcast(payload)
            sent += payload.numel() * payload.element_size()
        self._send_header(None)
        return sent

    def receive(self) -> Iterator[tuple[str, Tensor]]:
        """The tensors rank 0 sends, one at a time, until its end mark (ranks 1..N)."""
        while (header := self._receive_header()) is not None:
            name, shape, dtype = header
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self._broadcast(tensor)
            yield name, tensor

    def _broadcast(self, tensor: Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def _send_header(self, header: tuple[str, tuple[int, ...], torch.dtype] | None) -> None:
        """JSON (name, shape, dtype name), or nothing: the end mark."""
        data = b""
        if header is not None:
            name, shape, dtype = header
            data = json.dumps([name, list(shape), str(dtype).removeprefix("torch.")]).encode()
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        if data:
            self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def _receive_header(self) -> tuple[str, tuple[int, ...], torch.dtype] | None:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        if int(length.item()) == 0:
            return None
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        name, shape, dtype = json.loads(data.cpu().numpy().tobytes())
        return str(name), tuple(int(size) for size in shape), getattr(torch, str(dtype))
