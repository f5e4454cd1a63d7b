"""Processes found by a mark in their environment, and killed: what a program this process
started left running outside its process group (a ``setsid`` daemon, a child a close cut
short). Every process inherits its parent's environment unless it clears it, so a variable
set when the program starts marks all it starts. Linux only (``/proc``); elsewhere nothing
is found."""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass

KILL_WAIT_S = 0.5
"""How long killed processes get to die before those still alive are reported."""


@dataclass(frozen=True)
class Killed:
    killed: tuple[int, ...] = ()
    """The marked processes sent SIGKILL and gone."""
    survived: tuple[int, ...] = ()
    """The marked processes still alive after SIGKILL (another user's, say)."""


def new_mark() -> str:
    return uuid.uuid4().hex


def marked_processes(variable: str, mark: str) -> list[int]:
    """The live processes whose environment holds ``variable=mark``."""
    needle = f"{variable}={mark}".encode()
    found = []
    try:
        names = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return []
    for name in names:
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0") and _alive(int(name)):
                    found.append(int(name))
        except OSError:  # gone, or another user's
            continue
    return found


def kill_marked(variable: str, mark: str) -> Killed:
    """SIGKILL to every process marked ``variable=mark``; which died and which did not."""
    marked = marked_processes(variable, mark)
    for pid in marked:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    deadline = time.monotonic() + KILL_WAIT_S
    alive = [pid for pid in marked if _alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [pid for pid in alive if _alive(pid)]
    return Killed(tuple(p for p in marked if p not in alive), tuple(alive))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
