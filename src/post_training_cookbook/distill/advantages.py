"""The distillation phase of a step: the teacher's log-probabilities of the batch's sampled
tokens, the student's, and the advantages they give.

    A_t = [A_env_t] + distill_coef · (log π_teacher(o_t) − log π_student(o_t))

on every sampled token o_t, in the context the student had (tool results and template glue
are context, not scored). ``A_env_t`` is the GRPO advantage the batch already holds, left out
with ``distill_env_advantage=False`` (then every group trains, reward variance or not).
log π_student is the trainer's, before this step's update (``ModelService.forward``): with
the same weights as teacher it is the teacher's number to the bit, and the advantage is 0.

The teacher is called on chunks of ``sequences_per_call`` samples, all at once (the endpoint
bounds how many are in flight). A chunk that fails after the teacher's retries follows
``env_errors``: ``"raise"`` stops the run naming the teacher; ``"truncate"`` and ``"retry"``
drop the chunk's samples from the step, counted in ``distill/teacher_failed_samples``. An
answer of the wrong shape, or with a log-probability that is not finite or not in
[-1000, 0] (``endpoint.py``'s ``prompt_logprobs``), is such a failure too, never trained on,
and also counted in ``distill/teacher_malformed_samples``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from post_training_cookbook.distill.types import (
    Teacher,
    TeacherAnswerError,
    TeacherCallError,
    TeacherError,
)
from post_training_cookbook.rollout.types import EnvErrorPolicy
from post_training_cookbook.service.base import ModelService
from post_training_cookbook.trainer.types import TrainingSample

TEACHER_FAILURES = (TeacherCallError, TimeoutError, OSError)
"""What a teacher call may fail with and the step survive (under ``env_errors`` other than
``"raise"``): a request that failed after its retries, a timeout, the machine's I/O."""


@dataclass(frozen=True)
class DistillSettings:
    coef: float = 1.0
    """distill_coef: the weight of the teacher's per-token advantage."""
    env_advantage: bool = True
    """Whether the env's GRPO advantage is added (False: distillation alone)."""
    env_errors: EnvErrorPolicy = "raise"
    sequences_per_call: int | None = None
    """Samples per teacher call; None: the whole batch in one (a local teacher)."""


async def distill_batch(
    batch: Sequence[TrainingSample],
    teacher: Teacher,
    service: ModelService,
    settings: DistillSettings,
) -> tuple[list[TrainingSample], dict[str, float]]:
    """The samples with the teacher's advantages added (those of a failed teacher call left
    out), and the phase's metrics."""
    if not batch:
        return list(batch), {}
    started = time.perf_counter()
    chunks = _chunks(list(batch), settings.sequences_per_call)
    student_rows, *teacher_answers = await asyncio.gather(
        service.forward(list(batch)),
        *(teacher.score(chunk) for chunk in chunks),
        return_exceptions=True,
    )
    if isinstance(student_rows, BaseException):
        raise student_rows
    samples: list[TrainingSample] = []
    failed = malformed = 0
    gaps: list[float] = []
    teacher_values: list[float] = []
    student_iter = iter(student_rows)
    for chunk, answer in zip(chunks, teacher_answers, strict=True):
        students = [next(student_iter) for _ in chunk]
        if isinstance(answer, BaseException):
            if not isinstance(answer, TEACHER_FAILURES):
                raise answer  # a fault of ours or a teacher unfit to teach: never skipped
            if settings.env_errors == "raise":
                raise TeacherError(f"teacher {teacher.name}: {answer}") from answer
            failed += len(chunk)
            malformed += len(chunk) if isinstance(answer, TeacherAnswerError) else 0
            continue
        for sample, student, taught in zip(chunk, students, answer, strict=True):
            samples.append(_distilled(sample, student, taught, settings, gaps, teacher_values))
    metrics = {
        "distill/reverse_kl": statistics.fmean(gaps) if gaps else 0.0,
        "distill/teacher_logprob_mean": statistics.fmean(teacher_values) if gaps else 0.0,
        "distill/teacher_failed_samples": float(failed),
        "distill/teacher_malformed_samples": float(malformed),
        "time/teacher": time.perf_counter() - started,
    }
    return samples, metrics


def _distilled(
    sample: TrainingSample,
    student: Sequence[float],
    teacher: Sequence[float],
    settings: DistillSettings,
    gaps: list[float],
    teacher_values: list[float],
) -> TrainingSample:
    advantages = []
    for position, mask in enumerate(sample.mask):
        env = sample.advantages[position] if settings.env_advantage else 0.0
        if not mask:
            advantages.append(env)
            continue
        gap = student[position] - teacher[position]  # the token's reverse KL estimate
        gaps.append(gap)
        teacher_values.append(teacher[position])
        advantages.append(env - settings.coef * gap * mask)
    return replace(sample, advantages=advantages)


def _chunks(samples: list[TrainingSample], size: int | None) -> list[list[TrainingSample]]:
    step = size or len(samples)
    return [samples[start : start + step] for start in range(0, len(samples), step)]
