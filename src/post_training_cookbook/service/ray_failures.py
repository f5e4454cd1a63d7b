"""How ``RayModelService`` fails: its two errors, and the first failure of a fan-out told
apart from its consequences.

Failure: an actor that dies (process killed, OOM, node lost) fails the calls waiting on it
with ``WorkerDiedError`` naming it (``trainer rank 1 (pid 1234 on host)``) — Ray reports the
death, so nothing waits forever, and the ranks still alive give up their collectives after
the collective timeout. The service replaces no actor: the run stops and resumes from its
last checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any


class WorkerDiedError(RuntimeError):
    """A trainer or generator actor died; the message names it."""


class WeightSyncTimeoutError(TimeoutError):
    """A weights publication did not reach every generator in time."""


DEATH_REPORT_S = 10.0
"""How long a failed call waits for its peers' deaths to be reported: a rank whose peer was
killed fails its collective at once (connection reset), a little before Ray reports the
death, which is the error that names the cause."""


async def first_failure(calls: Sequence[asyncio.Future[Any]], timeout: float | None = None) -> None:
    """Wait for ``calls`` (at most ``timeout``); raise the first failure, preferring a
    ``WorkerDiedError`` reported within ``DEATH_REPORT_S`` of it. Calls still running are
    left to finish; their errors are consequences of the one raised."""
    done, pending = await asyncio.wait(calls, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    failed = [call for call in calls if call in done and call.exception() is not None]
    if failed and pending and not any(_died(call) for call in failed):
        more, pending = await asyncio.wait(
            pending, timeout=DEATH_REPORT_S, return_when=asyncio.FIRST_EXCEPTION
        )
        failed += [call for call in more if call.exception() is not None]
    for call in pending:
        call.add_done_callback(_retrieved)
    if failed:
        raise next((c for c in failed if _died(c)), failed[0]).exception()  # type: ignore[misc]


def _died(call: asyncio.Future[Any]) -> bool:
    return isinstance(call.exception(), WorkerDiedError)


def _retrieved(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()


async def outcome(ref: Awaitable[Any]) -> Any:
    """What ``ref`` returns, or the error it raises (closing: a dead or failing actor is
    killed anyway)."""
    try:
        return await ref
    except Exception as error:  # closing: a dead or failing actor is killed anyway
        return error
