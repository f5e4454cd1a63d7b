"""A model that scores tokens: for each sample, the log-probability of every sampled token
given the ones before it, by the trainer's own forward. Two callers, each with its own name
for it: on-policy distillation's local teacher (``distill/teacher.py``) and the policy
server's prompt scorer (``serve/prompt_scores.py``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from post_training_cookbook.trainer.types import TrainingSample

if TYPE_CHECKING:
    from post_training_cookbook.trainer.trainer import Trainer


class TokenScorer(Protocol):
    name: str

    async def score(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """Per sample, the log-probability of each sampled token given the ones before it
        (one value per token; 0.0 where ``mask`` is 0)."""
        ...

    async def close(self) -> None: ...


class LocalScorer:
    """Weights in a trainer of their own, forward only, in a worker thread."""

    def __init__(self, name: str, trainer: Trainer) -> None:
        self.name = name
        self._trainer = trainer
        self._lock = threading.Lock()  # one forward at a time on the one model

    async def score(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        return await asyncio.to_thread(self._score, list(samples))

    def _score(self, samples: list[TrainingSample]) -> list[list[float]]:
        import torch

        with self._lock, torch.inference_mode():
            return self._trainer.forward(samples)

    async def close(self) -> None:
        self._trainer.close()
