"""``GRPOConfig``: every setting of a GRPO run, validated when the config is built.

One dataclass serves both entry points (``train_multi_turn`` and ``train_single_turn``).
Each field is documented once, in the docstring right under it. ``docs/grpo_config.md``
shows the same fields as a table, and a test keeps the two in sync. Derived values (the
learning rate at a step, the loss config, the run directory) are methods here, so the loop
never computes them itself.

Building a config never loads or resolves the model: ``model`` may be a hub id that exists
only on the machine that trains. Checks that need the model (generator support, context
length, full-weight support) run when the run starts, before any weights load.

The config is frozen. To change a field, use ``dataclasses.replace``, which validates
again. This module itself imports neither torch nor wandb; its torch-backed helpers
(``sampling_params``, ``episode_limits``) import their records when called.
"""

from __future__ import annotations

import difflib
import enum
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from functools import cache
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.service.types import LossConfig, LossType, WeightSyncType

if TYPE_CHECKING:
    from os import PathLike

    from post_training_cookbook.engine.types import SamplingParams
    from post_training_cookbook.rollout import EpisodeLimits

__all__ = ["GRPOConfig", "WeightSyncType"]

AdvantageNormalization = Literal["mean", "mean_std"]
LRSchedule = Literal["constant", "linear", "cosine"]
EnvErrors = Literal["raise", "truncate"]
"""The same values as ``rollout.EnvErrorPolicy`` (a test checks this). Importing
``rollout`` here would pull torch into every config load."""
Dtype = Literal["float32", "bfloat16"]

_DEFERRED_SYNC = (
    WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH,
    WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE,
)


@dataclass(frozen=True)
class GRPOConfig:
    """Every setting of a GRPO run. Field table and validation rules: docs/grpo_config.md."""

    # Seed fields: the core settings the seed page's examples pass.
    model: str = BUNDLED_MODEL_ID
    """A catalog id (``models.list_models()``) or a local Hugging Face folder. The default,
    the bundled tool-use model, runs on a CPU and needs no download."""
    batch_size: int = 8
    """Tasks per optimizer step. Each task contributes one group."""
    episodes_per_task: int = 8
    """Group size: episodes sampled per task. Their mean reward is each one's baseline."""
    num_steps: int = 100
    """Optimizer steps in the run."""
    max_turns: int = 6
    """Assistant turns per episode. An episode that reaches it ends as ``MAX_TURNS``."""
    max_model_length: int = 2048
    """Tokens per episode: prompt, every turn and tool results. A turn that cannot fit ends
    the episode as ``CONTEXT_OVERFLOW``."""
    learning_rate: float = 1e-5
    """Peak learning rate, reached after ``warmup_steps``, then shaped by ``lr_schedule``."""
    max_sampling_attempts: int = 1
    """Dynamic sampling: up to this many sampling rounds per step to fill the batch with
    groups whose rewards vary (1 = a single round)."""
    wandb_project: str | None = "post-training-cookbook"
    """W&B project to log to (``WANDB_MODE=offline`` logs locally). None turns W&B off, and
    nothing of wandb is imported."""
    use_lora: bool = True
    """Train a LoRA adapter, as the hosted service does. False trains every weight."""
    overlong_masking: bool = False
    """Build no samples from truncated episodes of any cause. Their rewards still count in
    the group baseline."""
    failed_parse_reward: float = 0.0
    """Reward of an episode whose sampled message could not be parsed (``PARSE_FAILURE``)."""

    # Model and LoRA
    dtype: Dtype | None = None
    """Weights dtype. None takes the catalog's default for the model (float32 for the
    bundled model), or a local folder's ``torch_dtype``."""
    codec: str | None = None
    """Codec name (``"hermes"``, ``"qwen3"``). None takes the catalog's, or infers it from a
    local folder's chat template. Checked when the run builds its codec."""
    lora_rank: int = 16
    """LoRA rank r (with ``use_lora``)."""
    lora_alpha: int = 32
    """LoRA scale: the adapter's update is multiplied by ``lora_alpha / lora_rank``."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1)."""

    # Sampling and limits
    max_tokens_per_turn: int = 256
    """Tokens sampled per assistant turn. A turn cut there is parsed as it is."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (0 = greedy, which gives every group zero
    reward variance)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]. 1 keeps the whole distribution."""
    overlong_buffer_length: int = 256
    """DAPO's soft overlong penalty ramps over the last this-many tokens of
    ``max_model_length``. 0 turns the penalty off. Must be < ``max_model_length``."""
    overlong_penalty_factor: float = 1.0
    """The soft overlong penalty at ``max_model_length``. The reward falls by up to this
    much. 0 turns the penalty off."""

    # Loss (formulas in docs/losses.md)
    loss_type: LossType = "grpo"
    """Policy-gradient loss: ``"grpo"``, ``"dapo"``, ``"dr_grpo"``, ``"gspo"`` or
    ``"cispo"``."""
    advantage_normalization: AdvantageNormalization = "mean_std"
    """``"mean_std"``: advantage = (reward − group mean) / group std. ``"mean"``: reward −
    group mean. Dr. GRPO uses ``"mean"``; set it with ``loss_type="dr_grpo"``."""
    clip_low: float = 0.2
    """The ratio is clipped below at ``1 − clip_low``. CISPO ignores it."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high``. DAPO's clip-higher uses 0.28."""
    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to the initial policy. 0 turns it off."""
    tis_cap: float | None = None
    """Truncated importance sampling: cap of the sampler/trainer correction weight. None
    turns it off."""
    dr_grpo_horizon: int | None = None
    """Dr. GRPO's fixed horizon H (only with ``loss_type="dr_grpo"``). None uses the batch's
    longest trained span."""

    # Optimisation
    lr_schedule: LRSchedule = "constant"
    """Learning rate after warmup: ``"constant"``, or a ``"linear"`` / ``"cosine"`` decay to
    0 at ``num_steps``."""
    warmup_steps: int = 0
    """Steps of linear warmup from ``learning_rate / warmup_steps`` up to
    ``learning_rate``."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this total norm."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    micro_batch_tokens: int = 8192
    """Padded tokens per forward/backward micro-batch. A longer episode gets one alone, and
    episodes under 3/4 of a micro-batch's longest go to another, so padding stays under a
    quarter. Bounds memory, not the result."""

    # Async and scale-out
    max_steps_off_policy: int | None = None
    """Turns on async training. A group older than this many optimizer steps since its
    rollout started is dropped as stale. None = lockstep. Start with 1."""
    groups_in_flight: int | None = None
    """Rollout groups collected at once in async training. None = ``batch_size``."""
    weight_sync_type: WeightSyncType = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    """How new weights reach the generators. Also accepts the name or the short name
    (``"pipeline"``)."""
    num_generator_replicas: int = 1
    """Generator replicas that sample rollouts."""
    backend: Literal["local", "ray"] = "local"
    """Where the trainer and generators run: in this process, or as Ray actors (extra
    ``scale``; docs/scale_out.md)."""
    generation_engine: Literal["torch", "vllm"] = "torch"
    """The generators' sampling engine; ``"vllm"`` needs ``backend="ray"``."""
    ray_address: str | None = None
    """Ray cluster to join (``host:port``); None starts a local, loopback-only Ray."""
    weight_sync_timeout_s: float = 600.0
    """A weight publication that takes longer raises ``WeightSyncTimeoutError`` (Ray)."""

    # Runs and checkpoints
    run_name: str | None = None
    """Folder under ``runs_dir``. None: the loop names the run
    ``grpo-<model>-<UTC timestamp>`` once, with ``with_resolved_run_name()``."""
    runs_dir: str = "runs"
    """Where run folders live: config.yaml, metrics.jsonl, rollouts, checkpoints, model."""
    seed: int = 0
    """Seed of task order, sampling and initialisation."""
    checkpoint_interval: int = 10
    """A training checkpoint every this many steps. 0 = only the final one."""
    resume: bool = False
    """Continue ``runs_dir/run_name/`` from its last checkpoint. Needs ``run_name``."""

    # Validation
    validation_interval: int = 10
    """Steps between validations on ``val_tasks``. 0 = never."""
    sequential_validation: bool = False
    """Validate as a blocking phase at an exact policy version, not alongside training."""
    val_episodes_per_task: int = 1
    """Episodes per validation task."""
    val_temperature: float = 1.0
    """Sampling temperature of validation episodes (0 = greedy)."""

    # Env policy
    env_step_timeout_s: float | None = 60.0
    """An env ``reset``/``step``/``close`` that takes longer is an env error. None = no
    limit."""
    env_errors: EnvErrors = "raise"
    """``"raise"``: an env error stops the run, naming the task and turn (the seed's
    behaviour). ``"truncate"``: the episode ends as ``ENV`` and is counted."""

    def __post_init__(self) -> None:
        self._normalise()
        _raise_if_any(self._type_problems())
        _raise_if_any(self._value_problems())

    # Derived values

    @property
    def is_async(self) -> bool:
        return self.max_steps_off_policy is not None

    @property
    def effective_groups_in_flight(self) -> int:
        return self.groups_in_flight if self.groups_in_flight is not None else self.batch_size

    def loss_config(self) -> LossConfig:
        return LossConfig(
            loss_type=self.loss_type,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            kl_beta=self.kl_beta,
            tis_cap=self.tis_cap,
            dr_grpo_horizon=self.dr_grpo_horizon,
        )

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (counted from 0). The first
        ``warmup_steps`` steps ramp linearly up to ``learning_rate``. ``lr_schedule`` then
        runs over the remaining steps, towards 0 at ``num_steps``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.num_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.learning_rate * _SCHEDULES[self.lr_schedule](progress)

    def overlong_penalty(self, num_tokens: int) -> float:
        """DAPO's soft overlong penalty (<= 0) for an episode of ``num_tokens`` tokens. It is
        0 up to ``max_model_length - overlong_buffer_length``, then falls linearly to
        ``-overlong_penalty_factor`` at ``max_model_length``. The loop adds it only to
        ``CONTEXT_OVERFLOW`` and ``MAX_TURNS`` truncations."""
        if self.overlong_buffer_length == 0:
            return 0.0
        start = self.max_model_length - self.overlong_buffer_length
        excess = min(max(num_tokens - start, 0), self.overlong_buffer_length)
        return -self.overlong_penalty_factor * excess / self.overlong_buffer_length

    def sampling_params(self, *, validation: bool = False) -> SamplingParams:
        """Per-turn sampling settings of training (or validation) episodes."""
        # Imported here: the engine package imports torch, which a config alone needs not.
        from post_training_cookbook.engine.types import SamplingParams

        temperature = self.val_temperature if validation else self.temperature
        return SamplingParams(
            max_tokens=self.max_tokens_per_turn, temperature=temperature, top_p=self.top_p
        )

    def episode_limits(self) -> EpisodeLimits:
        """The limits and env error policy that ``rollout.run_episode`` applies."""
        # Imported here: rollout imports the codecs, which import transformers.
        from post_training_cookbook.rollout import EpisodeLimits

        return EpisodeLimits(
            max_turns=self.max_turns,
            max_model_length=self.max_model_length,
            max_tokens_per_turn=self.max_tokens_per_turn,
            failed_parse_reward=self.failed_parse_reward,
            env_step_timeout_s=self.env_step_timeout_s,
            env_errors=self.env_errors,
        )

    def resolved_run_name(self, now: datetime | None = None) -> str:
        """``run_name``, or ``grpo-<model short name>-<UTC timestamp>`` when it is None.
        The timestamp changes from call to call, so the loop fixes the name once with
        ``with_resolved_run_name()``."""
        if self.run_name is not None:
            return self.run_name
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
        return f"grpo-{_model_short_name(self.model)}-{stamp}"

    def with_resolved_run_name(self, now: datetime | None = None) -> GRPOConfig:
        """This config with ``run_name`` fixed. The loop calls it once and writes the result
        to config.yaml, so that the saved config resumes the same folder."""
        if self.run_name is not None:
            return self
        return replace(self, run_name=self.resolved_run_name(now))

    def run_dir(self) -> Path:
        """``runs_dir/run_name``. ``run_name`` must be set (see ``with_resolved_run_name``)."""
        if self.run_name is None:
            raise ValueError(
                "run_dir() needs a run_name: call config.with_resolved_run_name() once, so "
                "that every file of the run lands in one folder"
            )
        return Path(self.runs_dir) / self.run_name

    # Serialisation

    def to_dict(self) -> dict[str, Any]:
        """Every field, with enums as their names, so a YAML dump stays readable."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GRPOConfig:
        """A config from field values. An unknown key or a value of the wrong type raises
        ``ValueError``. A missing key takes its default."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a GRPOConfig is a mapping of field names, got {type(data)}")
        names = [f.name for f in fields(cls)]
        unknown = [_unknown_key(key, names) for key in data if key not in names]
        _raise_if_any(unknown)
        return cls(**data)

    def to_yaml(self, path: str | PathLike[str]) -> Path:
        """Write every field to ``path`` (folders created), loadable with ``from_yaml``."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        target.write_text(_YAML_HEADER + body)
        return target

    @classmethod
    def from_yaml(cls, path: str | PathLike[str]) -> GRPOConfig:
        """Load a config written by ``to_yaml`` or by hand (an empty file is the defaults).
        ``ValueError`` names the file and the bad key."""
        source = Path(path)
        try:
            data = yaml.load(source.read_text(), Loader=ConfigYamlLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"{source}: not valid YAML: {exc}") from exc
        try:
            return cls.from_dict({} if data is None else data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc

    # Validation, in three passes: normalise, then types, then values and combinations.

    def _normalise(self) -> None:
        try:
            sync = WeightSyncType.parse(self.weight_sync_type)
        except ValueError as exc:
            raise ValueError(f"GRPOConfig: weight_sync_type: {exc}") from exc
        object.__setattr__(self, "weight_sync_type", sync)
        # An int where a float is expected is fine (learning_rate=1); store it as a float
        # so that the YAML dump and equality do not depend on how it was written.
        for name, hint in _field_types().items():
            value = getattr(self, name)
            if _is_int(value) and (hint is float or float in get_args(hint)):
                object.__setattr__(self, name, float(value))

    def _type_problems(self) -> list[str]:
        problems = []
        for name, hint in _field_types().items():
            value = getattr(self, name)
            if not _matches(value, hint):
                problems.append(_type_problem(name, hint, value))
        return problems

    def _value_problems(self) -> list[str]:
        return [
            *self._range_problems(),
            *self._length_problems(),
            *self._loss_problems(),
            *self._async_problems(),
            *self._run_problems(),
        ]

    def _range_problems(self) -> list[str]:
        problems = self._generic_problems()
        for name, minimum in _AT_LEAST.items():
            value = getattr(self, name)
            if value is not None and value < minimum:
                problems.append(_below_minimum(name, minimum, value))
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be > 0, got {value}")
        for name in _NON_NEGATIVE:
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}; 1 turns it off")
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        return problems

    def _generic_problems(self) -> list[str]:
        """Rules for every field of a kind: floats are finite, strings are not empty."""
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{f.name} must be a finite number, got {value}")
            if isinstance(value, str) and not value.strip():
                problems.append(f"{f.name} must not be empty (use None where that is allowed)")
        return problems

    def _length_problems(self) -> list[str]:
        problems = []
        if self.max_tokens_per_turn > self.max_model_length:
            problems.append(
                f"max_tokens_per_turn ({self.max_tokens_per_turn}) must be <= "
                f"max_model_length ({self.max_model_length}): lower max_tokens_per_turn "
                "or raise max_model_length"
            )
        if self.overlong_buffer_length >= self.max_model_length:
            problems.append(
                f"overlong_buffer_length ({self.overlong_buffer_length}) must be < "
                f"max_model_length ({self.max_model_length}); 0 turns the soft penalty off"
            )
        if self.warmup_steps > self.num_steps:
            problems.append(
                f"warmup_steps ({self.warmup_steps}) must be <= num_steps ({self.num_steps})"
            )
        return problems

    def _loss_problems(self) -> list[str]:
        problems = []
        try:
            self.loss_config()
        except ValueError as exc:  # LossConfig names the field (clip_low, tis_cap, ...)
            problems.append(str(exc))
        if self.dr_grpo_horizon is not None and self.loss_type != "dr_grpo":
            problems.append(
                f"dr_grpo_horizon is used only by loss_type='dr_grpo' (got loss_type="
                f"{self.loss_type!r}): set loss_type='dr_grpo' or dr_grpo_horizon=None"
            )
        return problems

    def _async_problems(self) -> list[str]:
        problems = []
        sync = self.weight_sync_type.name
        if self.weight_sync_type in _DEFERRED_SYNC and not self.is_async:
            problems.append(
                f"weight_sync_type={sync} requires max_steps_off_policy (async training), "
                "because max_steps_off_policy bounds and measures the drift deferred "
                "publication allows: set max_steps_off_policy (e.g. 1) or use "
                "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
            )
        if self.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE and self.use_lora:
            problems.append(
                f"weight_sync_type={sync} requires full-weight training (use_lora=False): "
                "set use_lora=False or use WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
            )
        if self.generation_engine == "vllm" and self.backend != "ray":
            problems.append(
                'generation_engine="vllm" requires backend="ray" (vLLM allows one engine per '
                'process): set backend="ray" or use generation_engine="torch"'
            )
        if self.ray_address is not None and self.backend != "ray":
            problems.append('ray_address applies only to backend="ray"')
        if self.groups_in_flight is not None and not self.is_async:
            problems.append(
                "groups_in_flight applies only to async training: set max_steps_off_policy "
                "(e.g. 1) or leave groups_in_flight=None"
            )
        return problems

    def _run_problems(self) -> list[str]:
        problems = []
        if self.resume and self.run_name is None:
            problems.append(
                "resume=True needs run_name: name the run to continue (its folder under "
                f"{self.runs_dir!r})"
            )
        if self.run_name is not None and not _is_folder_name(self.run_name):
            problems.append(
                f"run_name must be a single folder name, got {self.run_name!r}; "
                "set runs_dir for the parent folder"
            )
        return problems


_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}
"""Learning-rate multiplier after warmup, by ``lr_schedule``, at progress in [0, 1]."""

_AT_LEAST: dict[str, int] = {
    "batch_size": 1,
    "episodes_per_task": 2,
    "num_steps": 1,
    "max_turns": 1,
    "max_model_length": 1,
    "max_sampling_attempts": 1,
    "lora_rank": 1,
    "lora_alpha": 1,
    "max_tokens_per_turn": 1,
    "overlong_buffer_length": 0,
    "warmup_steps": 0,
    "micro_batch_tokens": 1,
    "max_steps_off_policy": 0,
    "groups_in_flight": 1,
    "num_generator_replicas": 1,
    "seed": 0,
    "checkpoint_interval": 0,
    "validation_interval": 0,
    "val_episodes_per_task": 1,
}
"""Smallest allowed value of each integer field (None, where allowed, is not checked)."""

_WHY_MINIMUM = {
    "episodes_per_task": "the baseline is the group's mean reward, so an episode alone has "
    "zero advantage and nothing to learn from",
    "max_steps_off_policy": "None keeps lockstep; 0 admits only groups started under the "
    "current policy",
}

_POSITIVE = ("learning_rate", "max_grad_norm", "env_step_timeout_s", "weight_sync_timeout_s")
_NON_NEGATIVE = ("temperature", "val_temperature", "weight_decay", "overlong_penalty_factor")

_YAML_HEADER = "# GRPOConfig: load with GRPOConfig.from_yaml; fields in docs/grpo_config.md\n"


class ConfigYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, which also reads ``1e-5`` as a float. YAML 1.1 wants a dot
    (``1.0e-5``), so a learning rate written the usual way would load as a string."""


ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@cache
def _field_types() -> dict[str, Any]:
    return get_type_hints(GRPOConfig)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value: object, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (the few kinds fields use)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(hint))
    if origin is Literal:
        return isinstance(value, str) and value in get_args(hint)
    if hint is type(None):
        return value is None
    if hint is float:
        return _is_int(value) or isinstance(value, float)
    if hint is int:
        return _is_int(value)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in get_args(hint))
    if hint is type(None):
        return "None"
    return str(getattr(hint, "__name__", hint))


def _type_problem(name: str, hint: Any, value: object) -> str:
    problem = f"{name} must be {_describe(hint)}, got {type(value).__name__} {value!r}"
    choices = _literal_choices(hint)
    if isinstance(value, str) and choices:
        close = difflib.get_close_matches(value, choices, n=1)
        if close:
            problem += f" (did you mean {close[0]!r}?)"
    return problem


def _literal_choices(hint: Any) -> list[str]:
    if get_origin(hint) is Literal:
        return [str(arg) for arg in get_args(hint)]
    return [choice for arg in get_args(hint) for choice in _literal_choices(arg)]


def _below_minimum(name: str, minimum: int, value: int) -> str:
    optional = name in ("max_steps_off_policy", "groups_in_flight")
    problem = f"{name} must be >= {minimum}{' or None' if optional else ''}, got {value}"
    return f"{problem}: {_WHY_MINIMUM[name]}" if name in _WHY_MINIMUM else problem


def _unknown_key(key: object, names: list[str]) -> str:
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown GRPOConfig key {key!r}{hint}"


def _raise_if_any(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ValueError(f"GRPOConfig: {problems[0]}")
    if problems:
        raise ValueError("GRPOConfig:\n- " + "\n- ".join(problems))


def _plain(value: object) -> object:
    return value.name if isinstance(value, enum.Enum) else value


def _is_folder_name(name: str) -> bool:
    # An empty name is reported by the generic not-empty rule.
    return not name.strip() or (PurePath(name).name == name and name not in (".", ".."))


def _model_short_name(model: str) -> str:
    """The last part of a model id or folder, safe in a folder name."""
    name = PurePath(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
