"""What both engines (``LocalEngine``, ``VLLMEngine``) share between their callers and their
worker thread: the weights update a caller queues, the version rules, the coroutines waiting
for a version, and the checks of a prompt before it is queued.

Each engine keeps its own condition variable; the classes here take no lock of their own, and
every call is made with the engine's condition held.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from post_training_cookbook.engine.rows import settle
from post_training_cookbook.engine.types import WeightsMode


@dataclass(frozen=True)
class WeightsUpdate:
    """Weights a caller queued for the worker to apply between two steps."""

    tensors: dict[str, torch.Tensor]
    version: int
    mode: WeightsMode
    adapter_config: dict[str, Any] | None = None
    """Set for a LoRA adapter (``tensors`` under PEFT's names; vLLM), None for full weights."""


class WeightVersions:
    """The versions of an engine's weights as its callers see them: the newest asked for
    (each update must be newer than the last), and the coroutines, on any event loop, waiting
    for one to be applied, woken from the worker thread."""

    def __init__(self, latest: int) -> None:
        self.latest = latest
        """Of the latest update asked for, applied or not."""
        self._waiting: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def check_newer(self, version: int) -> None:
        if version <= self.latest:
            raise ValueError(f"version must increase: got {version}, latest is {self.latest}")

    def ask(self, version: int) -> None:
        """Record an update of ``version`` as queued (``ValueError`` unless it is newer)."""
        self.check_newer(version)
        self.latest = version

    def waiter(self, version: int) -> asyncio.Future[None]:
        """A future of the running loop, resolved once ``version`` (or newer) is applied."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((version, loop, future))
        return future

    def applied(self, version: int) -> None:
        """Wake the callers waiting for ``version`` or older."""
        ready = [waiter for waiter in self._waiting if waiter[0] <= version]
        self._waiting = [waiter for waiter in self._waiting if waiter[0] > version]
        for _, loop, future in ready:
            settle(loop, future)

    def fail(self, error: BaseException) -> None:
        """Fail every caller still waiting (the engine stopped)."""
        waiting, self._waiting = self._waiting, []
        for _, loop, future in waiting:
            settle(loop, future, error=error)


def check_prompt_ids(tokens: list[int], n: int, vocab_size: int) -> None:
    """``ValueError`` for a request no engine can take: ``n < 1``, no tokens, or ids outside
    the vocabulary."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not tokens:
        raise ValueError("prompt_tokens is empty")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise ValueError(f"prompt_tokens must be ids in [0, {vocab_size})")
