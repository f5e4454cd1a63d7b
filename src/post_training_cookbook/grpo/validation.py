"""GRPO's own config rules: the ones that read ``GRPOConfig``'s fields, and the words of the
simple ones. How a rule is stated and checked (``setting``, the generic rules, the type
checks, ``raise_if_any``) is every loop's, in ``runs/config.py``."""

from __future__ import annotations

from typing import Any, Protocol

from post_training_cookbook.lazy import module_getattr
from post_training_cookbook.runs.config import LoopConfig, on_ray
from post_training_cookbook.service.types import VLLM_RECORDS_NO_ROUTES, WeightSyncType
from post_training_cookbook.trainer.types import LossConfig, LossType


class GRPOFields(LoopConfig, Protocol):
    """What the rules below read of a ``GRPOConfig`` (whose fields name these rules, so the
    rules name the fields they read, not the class)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def use_lora(self) -> bool: ...
    @property
    def loss_type(self) -> LossType: ...
    @property
    def clip_low(self) -> float: ...
    @property
    def clip_high(self) -> float: ...
    @property
    def kl_beta(self) -> float: ...
    @property
    def tis_cap(self) -> float | None: ...
    @property
    def dr_grpo_horizon(self) -> int | None: ...
    @property
    def turn_rewards(self) -> str: ...
    @property
    def max_steps_off_policy(self) -> int | None: ...
    @property
    def num_generator_replicas(self) -> int: ...
    @property
    def generation_engine(self) -> str: ...
    @property
    def num_gpus_per_generator(self) -> float: ...


MAX_GROUPS_IN_FLIGHT = 1024
"""Most rollout groups an async run keeps in flight, whatever else allows."""


def groups_in_flight_bound(config: GRPOFields, name: str, value: Any) -> str | None:
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


# ---------------------------------------------------------------- GRPOConfig's own rules
# The rules that read other fields, and the words of the simple ones.

WHY_GROUP = (
    "the baseline is the group's mean reward, so an episode alone has zero advantage and "
    "nothing to learn from"
)
WHY_OFF_POLICY = "None keeps lockstep; 0 admits only groups started under the current policy"
IN_0_1_CLOSED = "{name} must be in (0, 1] or None, got {value}"
IN_UNIT_INTERVAL = "{name} must be in [0, 1], got {value}"
BUFFER_ADVICE = "; 0 turns the soft penalty off"
IN_FLIGHT_NEEDS_ASYNC = (
    "groups_in_flight applies only to async training: set max_steps_off_policy (e.g. 1) or "
    "leave groups_in_flight=None"
)
_DEFERRED_SYNC = (
    WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH,
    WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE,
)


def is_async(config: GRPOFields) -> bool:
    return config.max_steps_off_policy is not None


def loss_settings_valid(config: GRPOFields, name: str, value: Any) -> str | None:
    """The loss fields as ``LossConfig`` checks them (it names the field: clip_low, ...)."""
    try:
        loss_config_of(config)
    except ValueError as exc:
        return str(exc)
    return None


def only_with_dr_grpo(config: GRPOFields, name: str, value: Any) -> str | None:
    if value is None or config.loss_type == "dr_grpo":
        return None
    return (
        f"dr_grpo_horizon is used only by loss_type='dr_grpo' (got loss_type="
        f"{config.loss_type!r}): set loss_type='dr_grpo' or dr_grpo_horizon=None"
    )


def discount_needs_per_step(config: GRPOFields, name: str, value: Any) -> str | None:
    if value == 1.0 or config.turn_rewards == "per_step":
        return None
    return (
        f"turn_discount={value} discounts per-step returns, used only by "
        f"turn_rewards='per_step' (got turn_rewards={config.turn_rewards!r}): set "
        "turn_rewards='per_step' or leave turn_discount=1.0"
    )


def deferred_sync_needs_async(config: GRPOFields, name: str, value: Any) -> str | None:
    if value not in _DEFERRED_SYNC or is_async(config):
        return None
    return (
        f"weight_sync_type={value.name} requires max_steps_off_policy (async training), "
        "because max_steps_off_policy bounds and measures the drift deferred publication "
        "allows: set max_steps_off_policy (e.g. 1) or use WEIGHT_SYNC_TYPE_SYNCHRONOUS"
    )


def pipeline_needs_full_weight(config: GRPOFields, name: str, value: Any) -> str | None:
    if value is not WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE or not config.use_lora:
        return None
    return (
        f"weight_sync_type={value.name} requires full-weight training (use_lora=False): "
        "set use_lora=False or use WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
    )


def one_vllm_engine_per_process(config: GRPOFields, name: str, value: Any) -> str | None:
    if value != "vllm" or on_ray(config) or config.num_generator_replicas == 1:
        return None
    return (
        f'generation_engine="vllm" with backend="local" takes num_generator_replicas=1, got '
        f"{config.num_generator_replicas} (vLLM allows one engine per process): set "
        'backend="ray" for several replicas'
    )


def replay_needs_torch_engine(config: GRPOFields, name: str, value: Any) -> str | None:
    return VLLM_RECORDS_NO_ROUTES if value and config.generation_engine == "vllm" else None


def transport_on_ray(config: GRPOFields, name: str, value: Any) -> str | None:
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


def vllm_only(config: GRPOFields, name: str, value: Any) -> str | None:
    defaults = {"vllm_tensor_parallel_size": 1, "vllm_enforce_eager": True}
    if config.generation_engine in ("vllm", "auto") or value in (None, defaults.get(name)):
        return None
    return f'{name} applies to generation_engine="vllm" (or "auto" picking vLLM)'


def torch_engine_only(config: GRPOFields, name: str, value: Any) -> str | None:
    if value is None or config.generation_engine != "vllm":
        return None
    return (
        f'{name} bounds the torch engine\'s prefix cache; generation_engine="vllm" manages its '
        "own KV cache (vllm_gpu_memory_utilization)"
    )


def tensor_parallel_fits(config: GRPOFields, name: str, value: Any) -> str | None:
    if value > 1 and not on_ray(config):
        return f'vllm_tensor_parallel_size={value} needs backend="ray" (a generator actor)'
    if value <= 1 or config.num_gpus_per_generator >= value:
        return None
    return (
        f"vllm_tensor_parallel_size={value} needs as many GPUs per generator: set "
        f"num_gpus_per_generator={value} (got {config.num_gpus_per_generator})"
    )


def loss_config_of(config: GRPOFields) -> LossConfig:
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


_MOVED_TO_RUNS = {
    "DEVICE_PATTERN",
    "IN_0_1",
    "RAY_ADDRESS_NEEDS_RAY",
    "admits_float",
    "at_least",
    "at_most",
    "at_most_field",
    "device_name",
    "device_on_local",
    "field_rules",
    "folder_name",
    "gpus_on_ray",
    "holds",
    "is_int",
    "matches",
    "non_negative",
    "only_when",
    "positive",
    "raise_if_any",
    "resume_needs_run_name",
    "sharded_trainer_on_ray",
    "type_problem",
    "unknown_key",
    "value_problems",
}
__getattr__ = module_getattr(
    __name__, moved=dict.fromkeys(_MOVED_TO_RUNS, "post_training_cookbook.runs.config")
)
