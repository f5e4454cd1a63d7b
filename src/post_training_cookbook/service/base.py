"""``ModelService``: the one interface between a training loop and a model.

A model resource is one trainer and ``num_generator_replicas`` generators. The GRPO loop
uses nothing else, so a user can write their own loop on it, and the local, in-process
implementation (``LocalModelService``) and a distributed one are interchangeable.

Policy versions: 0 is the initial model; each applied ``optim_step`` adds 1. A sampled
sequence records the version(s) that produced it (``SampledSequence.policy_segments``).
``weights_sync`` makes the trainer's current version available to the generators.
"""

from __future__ import annotations

import abc
import contextlib
import os
import time
from collections.abc import Iterator, Sequence

from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.service.types import PolicyState, WeightSyncType
from post_training_cookbook.trainer.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    TrainingSample,
)

PathLike = str | os.PathLike[str]


class ModelService(abc.ABC):
    @abc.abstractmethod
    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        """``n`` completions of ``prompt_tokens`` from a generator."""

    @abc.abstractmethod
    async def forward(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """The trainer's per-token logprobs of each sample (0.0 where the mask is 0)."""

    @abc.abstractmethod
    async def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        """Accumulate the gradient of ``loss`` over ``samples``."""

    @abc.abstractmethod
    async def optim_step(self, learning_rate: float) -> OptimStepResult:
        """Apply the accumulated gradient (skipped, and reported, when it is not finite)."""

    @abc.abstractmethod
    async def weights_sync(
        self, weight_sync_type: WeightSyncType = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    ) -> int:
        """Publish the trainer's weights to the generators; return the version published
        (available now for SYNCHRONOUS, queued for the deferred types)."""

    @abc.abstractmethod
    def policy_state(self) -> PolicyState: ...

    @abc.abstractmethod
    def generator_idle_s(self) -> float:
        """Seconds so far during which no generator had a sampling request in flight."""

    @abc.abstractmethod
    async def save_training_checkpoint(self, path: PathLike) -> None:
        """Weights or adapter, optimizer state and step: everything needed to resume."""

    @abc.abstractmethod
    async def load_training_checkpoint(self, path: PathLike, *, load_optimizer: bool = True) -> int:
        """Restore a training checkpoint and publish it to the generators; return its version.
        ``load_optimizer=False`` loads the weights only, with a fresh optimizer at step 0.
        A damaged checkpoint raises ``files.BadFileError`` naming the file and changes
        nothing (the trainer reads every file before it applies any), so that a resume can
        fall back to an older one."""

    @abc.abstractmethod
    async def save_inference_checkpoint(self, path: PathLike) -> None:
        """A folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads (merged LoRA)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class IdleClock:
    """Seconds during which no generator had a sampling request in flight (both services'
    ``generator_idle_s``): wrap each request in ``busy()``."""

    def __init__(self) -> None:
        self._requests = 0
        self._idle_since = time.perf_counter()
        self._idle_total = 0.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        if self._requests == 0:
            self._idle_total += time.perf_counter() - self._idle_since
        self._requests += 1
        try:
            yield
        finally:
            self._requests -= 1
            if self._requests == 0:
                self._idle_since = time.perf_counter()

    def idle_s(self) -> float:
        ongoing = time.perf_counter() - self._idle_since if self._requests == 0 else 0.0
        return self._idle_total + ongoing
