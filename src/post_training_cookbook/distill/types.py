"""What crosses the edge of on-policy distillation: the ``Teacher`` a loop calls, the
``TeacherSpec`` it opens one from, and the errors a teacher raises. ``teacher.py`` (the local
teacher, ``open_teacher``) and ``endpoint.py`` (a teacher behind an endpoint) both build on
these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from post_training_cookbook.distill.config import is_endpoint
from post_training_cookbook.trainer.scoring import TokenScorer


class TeacherError(RuntimeError):
    """The teacher failed (after its retries) under ``env_errors="raise"``, or answered in a
    way that shows it is not fit to teach (another tokenizer)."""


class TeacherCallError(RuntimeError):
    """A teacher call that failed after its retries: the step survives it unless
    ``env_errors="raise"``."""


class TeacherAnswerError(TeacherCallError):
    """A teacher's answer of the wrong shape, or with a log-probability that is not a finite
    number in range: a failed call (under ``env_errors``), counted apart, never trained on."""


class Teacher(TokenScorer, Protocol):
    """On-policy distillation's teacher: a token scorer (``score``: per sample, the
    log-probability of each sampled token given the ones before it; 0.0 where ``mask`` is 0),
    local (``LocalTeacher``) or an endpoint (``distill/endpoint.py``)."""


@dataclass(frozen=True)
class ScoringSettings:
    """How the local teacher batches: as the student's trainer does, so that a teacher
    equal to the student computes the same numbers."""

    micro_batch_tokens: int = 8192
    logprob_chunk_tokens: int | Literal["auto"] | None = "auto"
    device: str = "cpu"


@dataclass(frozen=True)
class TeacherSpec:
    """Which teacher a run opens, and how it calls it (from the run's ``TeacherConfig``)."""

    source: str
    """A catalog id, a folder, a run or a checkpoint; or an endpoint's ``http(s)://`` URL."""
    scoring: ScoringSettings = ScoringSettings()
    endpoint_model: str | None = None
    timeout_s: float = 60.0
    retries: int = 2
    max_concurrency: int = 8
    max_response_bytes: int | None = None
    """An endpoint's answer read at most (None: ``distill/endpoint.py``'s bound by the
    request's tokens)."""

    @property
    def is_endpoint(self) -> bool:
        return is_endpoint(self.source)
