"""How ``GRPOConfig`` states and checks its rules: a field declares its own rules with
``setting(default, *rules)``, and every rule is a small function of the config that returns
a problem (a sentence naming the field) or None.

The config collects every problem of every field, plus the type problems, and raises them in
one ``ValueError``, so a user fixes a config in one go.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from collections.abc import Callable
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from post_training_cookbook.service.types import VLLM_RECORDS_NO_ROUTES, WeightSyncType
from post_training_cookbook.trainer.types import LossConfig

if TYPE_CHECKING:
    from post_training_cookbook.grpo.config import GRPOConfig

Rule = Callable[[Any, str, Any], str | None]
"""(config, field name, value) → the problem, or None when the rule holds."""


def setting(default: Any, *rules: Rule) -> Any:
    """A config field with its default and the rules its value must keep."""
    return dataclasses.field(default=default, metadata={"rules": rules})


def field_rules(field: dataclasses.Field[Any]) -> tuple[Rule, ...]:
    return tuple(field.metadata.get("rules", ()))


def value_problems(config: Any) -> list[str]:
    """Every rule of every field of a config dataclass (``GRPOConfig``, ``SFTConfig``) that
    its value breaks, after the rules for every field of a kind: floats are finite, strings
    are not empty."""
    problems = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{f.name} must be a finite number, got {value}")
            continue
        if isinstance(value, str) and not value.strip():
            problems.append(f"{f.name} must not be empty (use None where that is allowed)")
        problems += [p for rule in field_rules(f) if (p := rule(config, f.name, value))]
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


def a_temperature(config: Any, name: str, value: Any) -> str | None:
    from post_training_cookbook.engine.types import temperature_problem

    problem = temperature_problem(value)
    return None if problem is None else f"{name} {problem}"


MAX_GROUPS_IN_FLIGHT = 1024
"""Most rollout groups an async run keeps in flight, whatever else allows."""


def groups_in_flight_bound(config: GRPOConfig, name: str, value: Any) -> str | None:
    """Groups in flight beyond what the next steps can train are only stale work: a step
    trains ``batch_size`` groups, and a group older than ``max_steps_off_policy`` steps is
    dropped, so at most ``batch_size * (max_steps_off_policy + 1)`` groups can be used (four
    times that leaves room for the groups dynamic sampling filters out)."""
    if value is None or config.max_steps_off_policy is None:
        return None
    usable = 4 * config.batch_size * (config.max_steps_off_policy + 1)
    bound = min(usable, MAX_GROUPS_IN_FLIGHT)
    if value <= bound:
        return None
    return (
        f"{name} must be <= {bound}, got {value}: a step trains batch_size "
        f"({config.batch_size}) groups and drops groups older than max_steps_off_policy "
        f"({config.max_steps_off_policy}) steps, so more in flight is stale work that slows "
        f"every step (the bound is 4 * batch_size * (max_steps_off_policy + 1), at most "
        f"{MAX_GROUPS_IN_FLIGHT})"
    )


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


# ---------------------------------------------------------------- GRPOConfig's own rules
# The rules that read other fields, and the words of the simple ones.

WHY_GROUP = (
    "the baseline is the group's mean reward, so an episode alone has zero advantage and "
    "nothing to learn from"
)
WHY_OFF_POLICY = "None keeps lockstep; 0 admits only groups started under the current policy"
IN_0_1 = "{name} must be in [0, 1), got {value}"
IN_0_1_CLOSED = "{name} must be in (0, 1] or None, got {value}"
IN_UNIT_INTERVAL = "{name} must be in [0, 1], got {value}"
TOP_P = "{name} must be in [1e-6, 1], got {value}; 1 turns it off"
FITS_CONTEXT = ": lower max_tokens_per_turn or raise max_model_length"
BUFFER_ADVICE = "; 0 turns the soft penalty off"
IN_FLIGHT_NEEDS_ASYNC = (
    "groups_in_flight applies only to async training: set max_steps_off_policy (e.g. 1) or "
    "leave groups_in_flight=None"
)
RAY_ADDRESS_NEEDS_RAY = 'ray_address applies only to backend="ray"'
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_DEFERRED_SYNC = (
    WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH,
    WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE,
)


def is_async(config: GRPOConfig) -> bool:
    return config.max_steps_off_policy is not None


def on_ray(config: GRPOConfig) -> bool:
    return config.backend == "ray"


def loss_settings_valid(config: GRPOConfig, name: str, value: Any) -> str | None:
    """The loss fields as ``LossConfig`` checks them (it names the field: clip_low, ...)."""
    try:
        loss_config_of(config)
    except ValueError as exc:
        return str(exc)
    return None


def only_with_dr_grpo(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value is None or config.loss_type == "dr_grpo":
        return None
    return (
        f"dr_grpo_horizon is used only by loss_type='dr_grpo' (got loss_type="
        f"{config.loss_type!r}): set loss_type='dr_grpo' or dr_grpo_horizon=None"
    )


def discount_needs_per_step(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value == 1.0 or config.turn_rewards == "per_step":
        return None
    return (
        f"turn_discount={value} discounts per-step returns, used only by "
        f"turn_rewards='per_step' (got turn_rewards={config.turn_rewards!r}): set "
        "turn_rewards='per_step' or leave turn_discount=1.0"
    )


TEACHER_MODEL_RULE = "teacher_model names an endpoint teacher's model: set teacher to its URL"
TEACHER_RESPONSE_RULE = (
    "teacher_max_response_bytes bounds an endpoint teacher's answers: set teacher to its URL"
)


def endpoint_teacher(config: GRPOConfig) -> bool:
    return config.teacher is not None and config.teacher.startswith(("http://", "https://"))


def teacher_source(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value is None or not value.startswith("http") or endpoint_teacher(config):
        return None
    return f"teacher={value!r} looks like a URL: write it as http(s)://host:port/v1"


def needs_teacher(default: Any) -> Rule:
    """A distillation setting other than its default needs a teacher."""

    def rule(config: Any, name: str, value: Any) -> str | None:
        if value == default or config.teacher is not None:
            return None
        return f"{name}={value!r} applies to on-policy distillation: set teacher too"

    return rule


def deferred_sync_needs_async(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value not in _DEFERRED_SYNC or is_async(config):
        return None
    return (
        f"weight_sync_type={value.name} requires max_steps_off_policy (async training), "
        "because max_steps_off_policy bounds and measures the drift deferred publication "
        "allows: set max_steps_off_policy (e.g. 1) or use WEIGHT_SYNC_TYPE_SYNCHRONOUS"
    )


def pipeline_needs_full_weight(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value is not WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE or not config.use_lora:
        return None
    return (
        f"weight_sync_type={value.name} requires full-weight training (use_lora=False): "
        "set use_lora=False or use WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
    )


def one_vllm_engine_per_process(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value != "vllm" or on_ray(config) or config.num_generator_replicas == 1:
        return None
    return (
        f'generation_engine="vllm" with backend="local" takes num_generator_replicas=1, got '
        f"{config.num_generator_replicas} (vLLM allows one engine per process): set "
        'backend="ray" for several replicas'
    )


def replay_needs_torch_engine(config: GRPOConfig, name: str, value: Any) -> str | None:
    return VLLM_RECORDS_NO_ROUTES if value and config.generation_engine == "vllm" else None


def device_name(config: GRPOConfig, name: str, value: Any) -> str | None:
    if DEVICE_PATTERN.fullmatch(value):
        return None
    return f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}"


def device_on_local(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value == "auto" or not on_ray(config):
        return None
    return (
        'device applies to backend="local"; Ray actors compute on the GPUs Ray gives them '
        "(num_gpus_per_trainer, num_gpus_per_generator)"
    )


def gpus_on_ray(config: GRPOConfig, name: str, value: Any) -> str | None:
    if not value or on_ray(config):
        return None
    return f'{name} applies to backend="ray"; with backend="local" set device instead'


def sharded_trainer_on_ray(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value == 1 or on_ray(config):
        return None
    return (
        f'num_trainer_workers={value} needs backend="ray": a sharded trainer is one process a '
        'worker, started by Ray; backend="local" trains in this process'
    )


def transport_on_ray(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value == "auto":
        return None
    if not on_ray(config):
        return f'weight_transport={value!r} applies to backend="ray"'
    if (
        value == "broadcast"
        and config.generation_engine == "vllm"
        and config.num_gpus_per_generator
    ):
        return (
            "weight_transport='broadcast' reaches vLLM engines on CPU only (vLLM's own "
            "weight-transfer API for GPUs is not built: docs/scale_out.md); use 'object_store'"
        )
    return None


def vllm_only(config: GRPOConfig, name: str, value: Any) -> str | None:
    defaults = {"vllm_tensor_parallel_size": 1, "vllm_enforce_eager": True}
    if config.generation_engine in ("vllm", "auto") or value in (None, defaults.get(name)):
        return None
    return f'{name} applies to generation_engine="vllm" (or "auto" picking vLLM)'


def torch_engine_only(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value is None or config.generation_engine != "vllm":
        return None
    return (
        f'{name} bounds the torch engine\'s prefix cache; generation_engine="vllm" manages its '
        "own KV cache (vllm_gpu_memory_utilization)"
    )


def tensor_parallel_fits(config: GRPOConfig, name: str, value: Any) -> str | None:
    if value > 1 and not on_ray(config):
        return f'vllm_tensor_parallel_size={value} needs backend="ray" (a generator actor)'
    if value <= 1 or config.num_gpus_per_generator >= value:
        return None
    return (
        f"vllm_tensor_parallel_size={value} needs as many GPUs per generator: set "
        f"num_gpus_per_generator={value} (got {config.num_gpus_per_generator})"
    )


def resume_needs_run_name(config: GRPOConfig, name: str, value: Any) -> str | None:
    if not value or config.run_name is not None:
        return None
    return (
        "resume=True needs run_name: name the run to continue (its folder under "
        f"{config.runs_dir!r})"
    )


def folder_name(config: GRPOConfig, name: str, value: Any) -> str | None:
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


def loss_config_of(config: GRPOConfig) -> LossConfig:
    """The loss fields as the trainer's ``LossConfig``."""
    return LossConfig(
        loss_type=config.loss_type,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        kl_beta=config.kl_beta,
        tis_cap=config.tis_cap,
        dr_grpo_horizon=config.dr_grpo_horizon,
    )


# ---------------------------------------------------------------- types


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
    if hint is float:
        return is_int(value) or isinstance(value, float)
    if hint is int:
        return is_int(value)
    return isinstance(value, hint)


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
    return str(getattr(hint, "__name__", hint))


def _literal_choices(hint: Any) -> list[str]:
    if get_origin(hint) is Literal:
        return [str(arg) for arg in get_args(hint)]
    return [choice for arg in get_args(hint) for choice in _literal_choices(arg)]
