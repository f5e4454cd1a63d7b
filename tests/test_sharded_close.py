"""How the ranks of a sharded trainer meet and part: the rendezvous port is held from before
its address is handed out, and closing a trainer ends its process group's threads then, not
during interpreter exit (``sharded.serve_rendezvous``, ``Shards.close``)."""

from __future__ import annotations

import datetime
import errno
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_trainer_packing import group_samples, tiny_model

from post_training_cookbook.trainer.sharded import TrainerGroup, serve_rendezvous, spawn_ranks
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings

GROUP_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")
"""Name prefixes of the threads gloo and c10d start."""


def group_threads() -> list[str]:
    names = (path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm"))
    return sorted(name for name in names if name.startswith(GROUP_THREADS))


def test_the_rendezvous_port_is_held_from_before_its_address_is_handed_out() -> None:
    """Another process binding the port in between (what a port probed free, closed, and
    bound later by rank 0 allows) is refused; the ranks reach the store there."""
    rendezvous = serve_rendezvous("127.0.0.1", 10.0)
    host, _, port = rendezvous.address.rpartition(":")
    with socket.socket() as intruder, pytest.raises(OSError) as refused:
        intruder.bind((host, int(port)))
    assert refused.value.errno == errno.EADDRINUSE
    timeout = datetime.timedelta(seconds=10)
    rank = dist.TCPStore(host, int(port), 2, is_master=False, timeout=timeout)
    rank.set("joined", "1")
    assert rendezvous.store.get("joined") == b"1"


def _step_then_close(rank: int, address: str, out: str) -> None:
    torch.set_num_threads(1)
    group = TrainerGroup(rank, 2, address, timeout_s=120.0)
    trainer = Trainer(
        tiny_model("qwen2"),
        TrainerSettings(use_lora=False, autocast_bf16=False, seed=1),
        group=group,
    )
    trainer.forward_backward(group_samples(), LossConfig())
    trainer.optim_step(1e-3)
    running = group_threads()
    trainer.close()
    trainer.close()  # a second close is harmless
    Path(out, f"rank{rank}.json").write_text(json.dumps([running, group_threads()]))


@pytest.mark.skipif(sys.platform != "linux", reason="threads are named in /proc")
def test_closing_a_sharded_trainer_ends_its_group_threads_before_it_returns(
    tmp_path: Path,
) -> None:
    """Destroying the process group alone leaves gloo's threads (and rank 0's store server)
    running, held by FSDP's state and DTensor's caches, into interpreter exit."""
    spawn_ranks(_step_then_close, (str(tmp_path),), nprocs=2, timeout_s=120.0)
    for rank in (0, 1):
        running, after_close = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert any(name.startswith("pt_gloo") for name in running)  # there were some to end
        assert after_close == []
