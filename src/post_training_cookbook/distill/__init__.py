"""On-policy distillation: a teacher scores every token the student sampled, in context, and
each token's advantage is the per-token reverse KL, −(log π_student − log π_teacher), alone or
added to the env's advantage with ``teacher.coef`` (docs/losses.md, On-policy distillation).

- ``config.py``: ``TeacherConfig``, the one ``teacher`` setting of a loop's config;
- ``types.py``: the ``Teacher`` protocol, ``TeacherSpec`` (which teacher a run opens) and the
  errors a teacher raises;
- ``teacher.py``: the local teacher (a catalog model, a folder, a run or a checkpoint, scored
  by the trainer's own forward), ``open_teacher`` and the tokenizer check;
- ``endpoint.py``: a teacher behind an OpenAI-compatible ``/v1/completions`` that returns
  prompt log-probabilities (vLLM's ``prompt_logprobs``; ``post-training-cookbook serve``);
- ``advantages.py``: the teacher's calls for a batch (concurrent, with retries; failures
  under ``env_errors``) and the advantages they give.
"""

from post_training_cookbook.distill.advantages import DistillSettings, distill_batch
from post_training_cookbook.distill.config import TeacherConfig
from post_training_cookbook.distill.endpoint import EndpointTeacher
from post_training_cookbook.distill.teacher import LocalTeacher, check_same_tokenizer, open_teacher
from post_training_cookbook.distill.types import Teacher, TeacherError, TeacherSpec

__all__ = [
    "DistillSettings",
    "EndpointTeacher",
    "LocalTeacher",
    "Teacher",
    "TeacherConfig",
    "TeacherError",
    "TeacherSpec",
    "check_same_tokenizer",
    "distill_batch",
    "open_teacher",
]
