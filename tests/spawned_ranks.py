"""Ranks of a sharded trainer as spawned processes meeting over loopback gloo (no Ray), for
the tests that compare a sharded step with one process's: no tests live here.

``spawn_ranks(fn, args)`` runs ``fn(rank, address, *args)`` in ``nprocs`` fresh processes,
``address`` a free loopback port for the rendezvous. A rank killed by SIGABRT is run again
once, all ranks anew on a new port: a rank has died that way within a second of the
rendezvous ("terminate called without an active exception", from C++, not from our code)
in one CI run, and in 1 of about 150 spawns of the bare two-rank step in a loop on these 2
cores, where it could not be pinned to a line. What the ranks compute is still checked by
the test; a second abort, or a rank that fails any other way, fails it.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

ABORT_RETRIES = 1


def free_loopback_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2) -> None:
    for attempt in range(ABORT_RETRIES + 1):
        try:
            mp.spawn(fn, args=(free_loopback_address(), *args), nprocs=nprocs)
            return
        except ProcessExitedException as error:
            if error.signal_name != "SIGABRT" or attempt == ABORT_RETRIES:
                raise
            warnings.warn(
                f"rank {error.error_index} aborted (SIGABRT); running the ranks again",
                stacklevel=2,
            )
