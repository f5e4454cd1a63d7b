"""How a loop's config (``GRPOConfig``, ``SFTConfig``) states and checks its rules, below
every loop: a field declares its own rules with ``setting(default, *rules)``, and every rule
is a small function of the config that returns a problem (a sentence naming the field) or
None. The config collects every problem of every field, plus the type problems
(``matches``, ``type_problem``), and raises them in one ``ValueError`` (``raise_if_any``), so
a user fixes a config in one go. Here too: what every loop's config reads (the YAML loader,
``Dtype``, the learning-rate schedule, a model's short name). A loop's own rules stay with
the loop (``grpo/validation.py``).

The rules below read only fields every loop's config has (``backend``, ``run_name``,
``runs_dir``), whatever the config class.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal, Protocol, Union, get_args, get_origin

import yaml

from post_training_cookbook.engine.types import temperature_problem
from post_training_cookbook.trainer.types import token_rows_problem


class LoopConfig(Protocol):
    """What the rules below read of a loop's config."""

    @property
    def backend(self) -> str: ...

    @property
    def run_name(self) -> str | None: ...

    @property
    def runs_dir(self) -> str: ...


LRSchedule = Literal["constant", "linear", "cosine"]


Dtype = Literal["float32", "bfloat16"]


class ConfigYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, which also reads ``1e-5`` as a float. YAML 1.1 wants a dot
    (``1.0e-5``), so a learning rate written the usual way would load as a string."""


ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def model_short_name(model: str) -> str:
    """The last part of a model id or folder, safe in a folder name."""
    name = PurePath(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


Rule = Callable[[Any, str, Any], str | None]
"""(config, field name, value) → the problem, or None when the rule holds."""


def setting(default: Any, *rules: Rule) -> Any:
    """A config field with its default and the rules its value must keep
    (``dataclasses.MISSING`` for the default: none, the field is required)."""
    return dataclasses.field(default=default, metadata={"rules": rules})


def field_rules(field: dataclasses.Field[Any]) -> tuple[Rule, ...]:
    return tuple(field.metadata.get("rules", ()))


def value_problems(config: Any, prefix: str = "", whole: Any = None) -> list[str]:
    """Every rule of every field of a config dataclass (``GRPOConfig``, a section of it) that
    its value breaks, after the rules for every field of a kind: floats are finite, strings
    are not empty. ``prefix``: where a nested config sits (``"teacher."``), to name its fields
    by their path. ``whole``: the config the rules read (a section's loop config)."""
    problems = []
    for f in dataclasses.fields(config):
        name, value = prefix + f.name, getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{name} must be a finite number, got {value}")
            continue
        if isinstance(value, str) and not value.strip():
            problems.append(f"{name} must not be empty (use None where that is allowed)")
        reader = config if whole is None else whole
        problems += [p for rule in field_rules(f) if (p := rule(reader, name, value))]
    return problems


def at_least(minimum: int, why: str = "", *, or_none: bool = False) -> Rule:
    def rule(config: Any, name: str, value: Any) -> str | None:
        # A string is one of the field's literals ("auto"): its type check said so.
        if value is None or isinstance(value, str) or value >= minimum:
            return None
        problem = f"{name} must be >= {minimum}{' or None' if or_none else ''}, got {value}"
        return f"{problem}: {why}" if why else problem

    return rule


def at_most(maximum: int, why: str) -> Rule:
    def rule(config: Any, name: str, value: Any) -> str | None:
        if value is None or value <= maximum:
            return None
        return f"{name} must be <= {maximum}, got {value}: {why}"

    return rule


def positive(config: Any, name: str, value: Any) -> str | None:
    return None if value is None or value > 0 else f"{name} must be > 0, got {value}"


def non_negative(config: Any, name: str, value: Any) -> str | None:
    return None if value >= 0 else f"{name} must be >= 0, got {value}"


def holds(predicate: Callable[[Any], bool], problem: str) -> Rule:
    """A rule on the value alone; ``problem`` is formatted with ``name`` and ``value``."""

    def rule(config: Any, name: str, value: Any) -> str | None:
        return None if predicate(value) else problem.format(name=name, value=value)

    return rule


def at_most_field(other: str, advice: str, *, strictly: bool = False) -> Rule:
    """The value must be <= (or, ``strictly``, <) the value of field ``other``."""

    def rule(config: Any, name: str, value: Any) -> str | None:
        limit = getattr(config, other)
        if value < limit or (value == limit and not strictly):
            return None
        relation = "<" if strictly else "<="
        return f"{name} ({value}) must be {relation} {other} ({limit}){advice}"

    return rule


def only_when(condition: Callable[[Any], bool], problem: str) -> Rule:
    """A value other than the default (None) needs ``condition`` of the config to hold."""

    def rule(config: Any, name: str, value: Any) -> str | None:
        return None if value is None or condition(config) else problem

    return rule


IN_0_1 = "{name} must be in [0, 1), got {value}"


def a_temperature(config: Any, name: str, value: Any) -> str | None:
    problem = temperature_problem(value)
    return None if problem is None else f"{name} {problem}"


def warmup_fits(config: Any, name: str, value: int) -> str | None:
    """Warmup ends by ``num_steps`` (when the run sets it)."""
    if config.num_steps is None or value <= config.num_steps:
        return None
    return f"{name} must be <= num_steps ({config.num_steps}), got {value}"


RAY_ADDRESS_NEEDS_RAY = 'ray_address applies only to backend="ray"'


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def on_ray(config: LoopConfig) -> bool:
    return config.backend == "ray"


def device_name(config: LoopConfig, name: str, value: Any) -> str | None:
    if DEVICE_PATTERN.fullmatch(value):
        return None
    return f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}"


def device_on_local(config: LoopConfig, name: str, value: Any) -> str | None:
    if value == "auto" or not on_ray(config):
        return None
    return (
        'device applies to backend="local"; Ray actors compute on the GPUs Ray gives them '
        "(num_gpus_per_trainer, num_gpus_per_generator)"
    )


def gpus_on_ray(config: LoopConfig, name: str, value: Any) -> str | None:
    if not value or on_ray(config):
        return None
    return f'{name} applies to backend="ray"; with backend="local" set device instead'


def sharded_trainer_on_ray(config: LoopConfig, name: str, value: Any) -> str | None:
    if value == 1 or on_ray(config):
        return None
    return (
        f'num_trainer_workers={value} needs backend="ray": a sharded trainer is one process a '
        'worker, started by Ray; backend="local" trains in this process'
    )


def token_rows_with_lora(config: Any, name: str, value: Any) -> str | None:
    return token_rows_problem(value, config.use_lora, sharded=config.num_trainer_workers > 1)


def resume_needs_run_name(config: LoopConfig, name: str, value: Any) -> str | None:
    if not value or config.run_name is not None:
        return None
    return (
        "resume=True needs run_name: name the run to continue (its folder under "
        f"{config.runs_dir!r})"
    )


def folder_name(config: LoopConfig, name: str, value: Any) -> str | None:
    if value is not None and not value.isprintable():
        return f"run_name must be printable (no control characters such as NUL), got {value!r}"
    # An empty name is reported by the generic not-empty rule.
    if (
        value is None
        or not value.strip()
        or (PurePath(value).name == value and value not in (".", ".."))
    ):
        return None
    return (
        f"run_name must be a single folder name, got {value!r}; set runs_dir for the parent folder"
    )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def admits_float(hint: Any) -> bool:
    return hint is float or float in get_args(hint)


def matches(value: object, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (the few kinds fields use)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(matches(value, arg) for arg in get_args(hint))
    if origin is Literal:
        return isinstance(value, str) and value in get_args(hint)
    if hint is type(None):
        return value is None
    if origin is tuple:  # tuple[X, ...]: YAML gives a list (``tuples_from_lists`` stores a tuple)
        return isinstance(value, tuple | list) and all(matches(v, get_args(hint)[0]) for v in value)
    if hint is float:
        return is_int(value) or isinstance(value, float)
    if hint is int:
        return is_int(value)
    return isinstance(value, hint)


def tuples_from_lists(config: Any, hints: dict[str, Any]) -> None:
    """Store a list given for a ``tuple[X, ...]`` field (as YAML gives it) as a tuple, so that
    the frozen config stays hashable and compares equal to one built in code."""
    for name, hint in hints.items():
        value = getattr(config, name)
        if get_origin(hint) is tuple and isinstance(value, list):
            object.__setattr__(config, name, tuple(value))


def type_problem(name: str, hint: Any, value: object) -> str:
    problem = f"{name} must be {_describe(hint)}, got {type(value).__name__} {value!r}"
    choices = _literal_choices(hint)
    if isinstance(value, str) and choices:
        close = difflib.get_close_matches(value, choices, n=1)
        if close:
            problem += f" (did you mean {close[0]!r}?)"
    return problem


def unknown_key(key: object, names: list[str], config_name: str = "GRPOConfig") -> str:
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {config_name} key {key!r}{hint}"


def raise_if_any(problems: list[str], config_name: str = "GRPOConfig") -> None:
    if len(problems) == 1:
        raise ValueError(f"{config_name}: {problems[0]}")
    if problems:
        raise ValueError(f"{config_name}:\n- " + "\n- ".join(problems))


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in get_args(hint))
    if hint is type(None):
        return "None"
    if origin is tuple:
        return f"a list of {_describe(get_args(hint)[0])}"
    return str(getattr(hint, "__name__", hint))


def _literal_choices(hint: Any) -> list[str]:
    if get_origin(hint) is Literal:
        return [str(arg) for arg in get_args(hint)]
    return [choice for arg in get_args(hint) for choice in _literal_choices(arg)]


_SHAPES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}
"""Learning-rate multiplier after warmup, by schedule, at progress in [0, 1]."""


@dataclass(frozen=True)
class LearningRateSchedule:
    peak: float
    num_steps: int
    warmup_steps: int = 0
    shape: LRSchedule = "constant"

    def at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (counted from 0). The first
        ``warmup_steps`` steps ramp linearly up to ``peak``; ``shape`` then runs over the
        remaining steps, towards 0 at ``num_steps``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.num_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.peak * _SHAPES[self.shape](progress)
