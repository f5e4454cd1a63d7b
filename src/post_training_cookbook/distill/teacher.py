"""The teacher of on-policy distillation: what it answers, the local one, and ``open_teacher``.

A teacher takes the student's training samples (whole episodes: prompts, tool results and
sampled tokens alike) and returns, for each, ``log p_teacher(tokens[t] | tokens[:t])`` at
the sampled positions (``mask`` 1), 0.0 elsewhere: tool results and template glue are
context, never scored.

The local teacher is a catalog model, a Hugging Face folder, a run directory or a training
checkpoint (what ``evaluate`` loads), scored by the trainer's own forward (``Trainer.forward``)
in a worker thread, micro-batched like the student's. So a teacher equal to the student
gives the student's log-probabilities to the bit, and a zero advantage.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from post_training_cookbook.distill.endpoint import EndpointTeacher
from post_training_cookbook.distill.types import ScoringSettings, Teacher, TeacherSpec
from post_training_cookbook.lazy import module_getattr
from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.runs.models import load_eval_weights, resolve_eval_model
from post_training_cookbook.trainer.scoring import LocalScorer
from post_training_cookbook.trainer.types import TrainerSettings


def teacher_model_info(source: str, config_type: Any = None) -> ModelInfo:
    """The catalog entry of a local teacher (a run or checkpoint: its base model's), from
    metadata alone. ``config_type``: the class a run's config.yaml is read with (the loop's)."""
    return resolve_eval_model(source, config_type=config_type).tokenizer_info


def check_same_tokenizer(student: ModelInfo, teacher_source: str, config_type: Any = None) -> None:
    """Refuse a local teacher whose tokenizer is not the student's, naming both, before any
    weights load: its log-probabilities would be of other tokens."""
    from post_training_cookbook.models.loading import load_tokenizer  # torch, transformers

    teacher = teacher_model_info(teacher_source, config_type)
    ours, theirs = load_tokenizer(student), load_tokenizer(teacher)
    if _tokenizer_identity(ours) != _tokenizer_identity(theirs):
        raise ValueError(
            f"teacher {teacher_source!r} ({teacher.source}) and student {student.model_id!r} "
            f"({student.source}) do not share a tokenizer ({len(theirs)} and {len(ours)} "
            "tokens, or other ids): a teacher scores the student's tokens, so it needs the "
            "student's tokenizer"
        )


def _tokenizer_identity(tokenizer: Any) -> tuple[Any, ...]:
    return (sorted(tokenizer.get_vocab().items()), tokenizer.eos_token, len(tokenizer))


class LocalTeacher(LocalScorer):
    """A model of ours as teacher: its weights in a trainer of their own, forward only."""

    @classmethod
    def load(cls, source: str, scoring: ScoringSettings, config_type: Any = None) -> LocalTeacher:
        """``config_type``: the class a run's config.yaml is read with (the loop's)."""
        from post_training_cookbook.trainer.trainer import Trainer  # torch, only for a local one

        weights = load_eval_weights(resolve_eval_model(source, config_type=config_type))
        settings = TrainerSettings(
            use_lora=False,  # autocast_bf16 as the student's trainer decides it
            micro_batch_tokens=scoring.micro_batch_tokens,
            logprob_chunk_tokens=scoring.logprob_chunk_tokens,
            device=scoring.device,
        )
        trainer = Trainer(weights, settings)
        return cls(source, trainer)


async def open_teacher(spec: TeacherSpec, student: str, config_type: Any = None) -> Teacher:
    """The run's teacher: an endpoint for an ``http(s)://`` URL, else a local model (a run's
    config.yaml read with ``config_type``, the loop's config class)."""
    if spec.is_endpoint:
        return EndpointTeacher(
            spec.source,
            model=spec.endpoint_model,
            api_key=os.environ.get(TEACHER_API_KEY_ENV),
            timeout_s=spec.timeout_s,
            retries=spec.retries,
            max_concurrency=spec.max_concurrency,
            max_response_bytes=spec.max_response_bytes,
            student=student,
        )
    return await asyncio.to_thread(LocalTeacher.load, spec.source, spec.scoring, config_type)


TEACHER_API_KEY_ENV = "TEACHER_API_KEY"
"""The environment variable an endpoint teacher's bearer token is read from (never the
config, which the run folder keeps)."""


_MOVED_TO_TYPES = {"TeacherAnswerError", "TeacherCallError", "TeacherError"}
__getattr__ = module_getattr(
    __name__, moved=dict.fromkeys(_MOVED_TO_TYPES, "post_training_cookbook.distill.types")
)
