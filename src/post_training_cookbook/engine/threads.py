"""Intra-op thread counts of worker threads, and the OpenMP pools of threads that hand their
compute to another thread.

Each thread that runs parallel torch ops keeps its own OpenMP pool (GNU libgomp, which
Linux torch wheels use), and once the process holds more OpenMP threads than CPUs, libgomp
cuts the spin-wait of idle pool threads to ~100 iterations: every small parallel op then
pays a futex wake-up: a decode step on a second thread beside the main thread's idle pool
ran up to twice as slow as with that pool released (docs/performance.md has the numbers).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads go, the runtime's state stays


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """libgomp if this process already loaded it (torch's, on Linux), else None."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return None
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def release_idle_openmp_pool() -> bool:
    """Let the calling thread's idle OpenMP workers exit; True when there was libgomp to ask.

    Call it from a thread that has handed its parallel work to another thread (the caller of
    ``LocalEngine``, the main thread of ``LocalModelService``, a lockstep trainer thread
    while the engines sample), outside any parallel region.
    libgomp frees the calling thread's pool only; torch starts a new one the next time this
    thread runs a parallel op, so the call changes speed, never results. Other OpenMP
    runtimes pause every thread's resources at once, so this is a no-op for them.
    """
    library = _libgomp()
    if library is None:
        return False
    return bool(library.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0)


def set_own_thread_count(count: int | None) -> int:
    """On a newly started worker thread: compute with ``count`` intra-op threads (None: the
    process default) and return the count it got. The caller should then restore the process
    default, which ``torch.set_num_threads`` also changed for threads started later."""
    # torch gives a thread its count on the thread's first parallel op, from the process
    # default: have that happen now, so that a default restored later does not override it.
    torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()
