"""Freed heap memory back to the operating system (glibc's ``malloc_trim``).

Tensors of up to a few tens of MiB come from malloc's per-thread arenas, and the pages of a
freed one stay with the arena that allocated it: what the engine's worker thread freed
cannot serve the trainer's thread, nor the reverse. A process that takes turns sampling
and training would hold both peaks at once; handing the free pages back between the turns
keeps it at the larger one (docs/performance.md, "Peak memory beside TRL"). A no-op where
the C library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Give every arena's free pages back to the OS; False where that is not possible."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
