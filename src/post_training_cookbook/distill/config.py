"""``TeacherConfig``: the settings of on-policy distillation, one nested field of a loop's
config (``GRPOConfig.teacher``), validated when it is built.

Stated with the machinery of every config (``setting(default, *rules)``, ``runs/config.py``);
a problem names the nested path (``teacher.coef must be > 0``). A plain string stands for
``TeacherConfig(source=...)`` (``GRPOConfig(teacher="some/model")``, the common case). The
flat names these settings had before (``distill_coef``, ``teacher_timeout_s``, ...) are
mapped here, with a warning, for one release (``nest_flat_teacher_names``).

This module imports neither torch nor wandb.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, get_type_hints

from post_training_cookbook.deprecation import REMOVAL_RELEASE
from post_training_cookbook.runs.config import (
    admits_float,
    at_least,
    at_most,
    is_int,
    matches,
    only_when,
    positive,
    raise_if_any,
    setting,
    type_problem,
    unknown_key,
    value_problems,
)

PATH = "teacher"
"""The field a loop's config holds a ``TeacherConfig`` in: problems are named under it."""


def is_endpoint(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def _endpoint(teacher: TeacherConfig) -> bool:
    return is_endpoint(teacher.source)


def _url_shaped(teacher: TeacherConfig, name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not value.startswith("http") or is_endpoint(value):
        return None
    return f"{name}={value!r} looks like a URL: write it as http(s)://host:port/v1"


MODEL_RULE = f"{PATH}.model names an endpoint teacher's model: set {PATH}.source to its URL"
RESPONSE_RULE = (
    f"{PATH}.max_response_bytes bounds an endpoint teacher's answers: set {PATH}.source to its URL"
)


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation: a teacher scores every token the student samples, in context;
    each token's advantage gets coef · (log π_teacher − log π_student). Field table:
    docs/grpo_config.md, On-policy distillation."""

    source: str = setting(dataclasses.MISSING, _url_shaped)  # MISSING: no default, required
    """A catalog id, a folder, a run or a checkpoint (sharing the student's tokenizer), or
    the ``http(s)://…/v1`` URL of an OpenAI-compatible endpoint that returns
    ``prompt_logprobs`` (vLLM, our ``serve``). Required."""
    model: str | None = setting(None, only_when(_endpoint, MODEL_RULE))
    """The model name an endpoint teacher serves. None: the first its ``/v1/models`` lists."""
    coef: float = setting(1.0, positive)
    """Weight of the teacher's per-token advantage."""
    env_advantage: bool = True
    """Add the env's GRPO advantage to the teacher's. False: distillation alone (every group
    trains, reward variance or not)."""
    timeout_s: float = setting(60.0, positive)
    """An endpoint teacher's request that takes longer fails (and is retried)."""
    retries: int = setting(2, at_least(0), at_most(20, "each retry waits a timeout"))
    """An endpoint teacher's failed request (timeout, 408, 409, 429, 5xx) is sent again up to
    this many times; what still fails follows ``env_errors``."""
    max_concurrency: int = setting(8, at_least(1))
    """An endpoint teacher's requests in flight at once."""
    max_response_bytes: int | None = setting(
        None, at_least(1, or_none=True), only_when(_endpoint, RESPONSE_RULE)
    )
    """An endpoint teacher's answer is read up to this many bytes; a longer one fails (not
    retried) and follows ``env_errors``. None: 1,000 bytes a token sent (vLLM writes about
    100), at least 1 MB."""
    sequences_per_call: int | None = setting(None, at_least(1, or_none=True))
    """Samples scored per teacher call. None: the whole batch at once for a local teacher
    (micro-batched as the student's), 8 a request for an endpoint."""

    def __post_init__(self) -> None:
        hints = _field_types()
        for name, hint in hints.items():  # an int for a float (coef=1): stored as a float
            if is_int(getattr(self, name)) and admits_float(hint):
                object.__setattr__(self, name, float(getattr(self, name)))
        raise_if_any(
            [
                type_problem(f"{PATH}.{name}", hint, getattr(self, name))
                for name, hint in hints.items()
                if not matches(getattr(self, name), hint)
            ],
            "TeacherConfig",
        )
        raise_if_any(value_problems(self, prefix=f"{PATH}."), "TeacherConfig")

    @property
    def is_endpoint(self) -> bool:
        return is_endpoint(self.source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, value: TeacherConfig | str | Mapping[str, Any]) -> TeacherConfig:
        """A teacher from its config, its source alone (the shorthand), or a mapping of its
        fields (as config.yaml writes it; an unknown key raises ``ValueError``)."""
        if isinstance(value, TeacherConfig):
            return value
        if isinstance(value, str):
            return cls(source=value)
        if not isinstance(value, Mapping):
            raise_if_any(
                [f"{PATH} must be a model, a run or an endpoint URL, or a mapping of its "
                 f"settings, got {type(value).__name__} {value!r}"]
            )  # fmt: skip
        paths = [f"{PATH}.{f.name}" for f in fields(cls)]
        problems = [
            unknown_key(f"{PATH}.{key}", paths, "TeacherConfig")
            for key in value
            if f"{PATH}.{key}" not in paths
        ]
        if "source" not in value:
            problems.append(f"{PATH}.source is required: a model, a run or an endpoint URL")
        raise_if_any(problems, "TeacherConfig")
        return cls(**value)


@cache
def _field_types() -> dict[str, Any]:
    return get_type_hints(TeacherConfig)


FLAT_TEACHER_NAMES = {
    "teacher_model": "model",
    "distill_coef": "coef",
    "distill_env_advantage": "env_advantage",
    "teacher_timeout_s": "timeout_s",
    "teacher_retries": "retries",
    "teacher_max_concurrency": "max_concurrency",
    "teacher_max_response_bytes": "max_response_bytes",
    "teacher_sequences_per_call": "sequences_per_call",
}
"""The flat names a loop's config had for these settings (``GRPOConfig(distill_coef=...)``,
in old run folders' config.yaml too) → their names in ``TeacherConfig``."""

_NEEDED_A_TEACHER = {"teacher_model", "distill_coef", "distill_env_advantage"}
"""Flat names whose value other than the default was refused without a teacher. The others
were accepted and did nothing; without a teacher they are dropped."""


def nest_flat_teacher_names(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (a config's keyword arguments or config.yaml's keys) with the flat
    distillation names folded into ``teacher``, warning once with the new spelling."""
    flat = {name: settings[name] for name in FLAT_TEACHER_NAMES if name in settings}
    nested = {name: value for name, value in settings.items() if name not in FLAT_TEACHER_NAMES}
    if not flat:
        return nested
    spelled = ", ".join(f"{name} → {PATH}.{FLAT_TEACHER_NAMES[name]}" for name in flat)
    warnings.warn(
        f"the flat distillation settings are now fields of {PATH} (a TeacherConfig; in YAML a "
        f"mapping under {PATH}:): {spelled}. The flat names go away in release {REMOVAL_RELEASE}",
        DeprecationWarning,
        stacklevel=3,
    )
    teacher = nested.get(PATH)
    defaults = {f.name: f.default for f in fields(TeacherConfig)}
    if teacher is None:  # an old config.yaml writes every flat key, at its default
        problems = [
            f"{name}={value!r} applies to on-policy distillation: set {PATH} too"
            for name, value in flat.items()
            if name in _NEEDED_A_TEACHER and value != defaults[FLAT_TEACHER_NAMES[name]]
        ]
        if flat.get("teacher_max_response_bytes") is not None:
            problems.append(RESPONSE_RULE)
        raise_if_any(problems)
        return nested
    renamed = {FLAT_TEACHER_NAMES[name]: value for name, value in flat.items()}
    if isinstance(teacher, Mapping):
        nested[PATH] = {**teacher, **renamed}
    elif isinstance(teacher, TeacherConfig):
        nested[PATH] = dataclasses.replace(teacher, **renamed)
    else:
        nested[PATH] = {"source": teacher, **renamed}
    return nested
