"""The sections a loop's config is composed of, each field defined once, here.

``GRPOConfig`` and ``SFTConfig`` hold these sections and, beside them, only their own fields
(``runs/composed.py`` says how a flat keyword reaches its section). A loop gives a section its
own defaults with ``section(SomeSettings(...))``; the class defaults below are GRPO's.

A field's rules may read fields of other sections (``max_tokens_per_turn`` must fit
``max_model_length``): a rule is handed the whole loop config, which reads every field by its
flat name. A section is validated when a loop's config holds it, so that every problem of
every section is raised at once.

This module imports neither torch nor wandb.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_type_hints

from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.runs.config import (
    IN_0_1,
    RAY_ADDRESS_NEEDS_RAY,
    Dtype,
    LRSchedule,
    a_temperature,
    admits_float,
    at_least,
    at_most,
    at_most_field,
    device_name,
    device_on_local,
    folder_name,
    gpus_on_ray,
    holds,
    is_int,
    non_negative,
    on_ray,
    only_when,
    positive,
    resume_needs_run_name,
    setting,
    sharded_trainer_on_ray,
    token_rows_with_lora,
    tuples_from_lists,
    warmup_fits,
)
from post_training_cookbook.service.types import Backend
from post_training_cookbook.trainer.types import Precision

FITS_CONTEXT = ": lower max_tokens_per_turn or raise max_model_length"
TOP_P = "{name} must be in [1e-6, 1], got {value}; 1 turns it off"


class Section:
    """Base of a section: stores a list given for a tuple field as a tuple, and an int given
    for a float field as a float, so that a section read from YAML equals one built in code.
    Validation is the loop config's (``runs/composed.py``)."""

    def __post_init__(self) -> None:
        hints = section_types(type(self))
        tuples_from_lists(self, hints)
        for name, hint in hints.items():
            value = getattr(self, name)
            if is_int(value) and admits_float(hint):
                object.__setattr__(self, name, float(value))


S = TypeVar("S", bound=Section)


def section(default: S) -> S:
    """A loop config's field that holds a section, with the loop's defaults for it."""
    return dataclasses.field(default_factory=lambda: default, metadata={"section": True})


def section_types(cls: type) -> dict[str, Any]:
    """A section's field types (resolved once per section)."""
    if cls not in _TYPES:
        _TYPES[cls] = get_type_hints(cls)
    return _TYPES[cls]


_TYPES: dict[type, dict[str, Any]] = {}


@dataclass(frozen=True)
class ModelSettings(Section):
    """Model and precision: which weights, how text becomes tokens, and where and in what
    precision they compute."""

    model: str = BUNDLED_MODEL_ID
    """A catalog id (``models.list_models()``) or a local Hugging Face folder. The default,
    the bundled tool-use model, runs on a CPU and needs no download."""
    codec: str | None = None
    """Codec name (``"hermes"``, ``"qwen3.8"``, ``"template"`` ...; docs/models.md). None takes
    the catalog's, or infers it from a local folder's chat template."""
    dtype: Dtype | None = None
    """The generators' weights dtype. None takes the catalog's default for the model
    (float32 for the bundled model), or a local folder's ``torch_dtype``. The trainer's
    weights follow ``trainer_precision``. SFT samples nothing: its final model is written
    from the trainer."""
    device: str = setting("auto", device_name, device_on_local)
    """Where the trainer and generators compute, together (``backend="local"``):
    ``"auto"`` (CUDA when present, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    trainer_precision: Precision = "fp32"
    """The trainer's weights: ``"fp32"`` (weights, gradients, AdamW state), or ``"bf16"``
    (bf16 weights and gradients, an fp32 master copy and moments in the optimizer). bf16
    halves frozen weights (the LoRA base); full-weight training holds the same bytes."""


@dataclass(frozen=True)
class SamplingSettings(Section):
    """How the policy samples: per turn, in training and in validation."""

    max_tokens_per_turn: int = setting(
        256, at_least(1), at_most_field("max_model_length", FITS_CONTEXT)
    )
    """Tokens sampled per assistant turn. A turn cut there is parsed as it is."""
    temperature: float = setting(1.0, a_temperature)
    """Sampling temperature of training rollouts: 0 (greedy, which gives every group zero
    reward variance) or at least 1e-3 (lower ones overflow the logits into NaN)."""
    top_p: float = setting(1.0, holds(lambda v: 1e-6 <= v <= 1, TOP_P))
    """Nucleus sampling mass, in [1e-6, 1]. 1 keeps the whole distribution."""
    val_temperature: float = setting(1.0, a_temperature)
    """Sampling temperature of validation episodes (0 = greedy, else at least 1e-3)."""


@dataclass(frozen=True)
class OptimizerSettings(Section):
    """Optimiser and schedule: what trains (LoRA or every weight), how far each step moves it,
    and for how many steps."""

    learning_rate: float = setting(1e-5, positive)
    """Peak learning rate, reached after ``warmup_steps``, then shaped by ``lr_schedule``."""
    lr_schedule: LRSchedule = "constant"
    """Learning rate after warmup: ``"constant"``, or a ``"linear"`` / ``"cosine"`` decay to
    0 at ``num_steps``."""
    warmup_steps: int = setting(0, at_least(0), warmup_fits)
    """Steps of linear warmup from ``learning_rate / warmup_steps`` up to
    ``learning_rate``; at most ``num_steps``."""
    num_steps: int | None = setting(100, at_least(1, or_none=True))
    """Optimizer steps in the run. GRPO needs a number; SFT's None takes as many as
    ``num_epochs`` passes over the data take (a number overrides ``num_epochs``)."""
    max_grad_norm: float = setting(1.0, positive)
    """Gradients are clipped to this total norm."""
    weight_decay: float = setting(0.0, non_negative)
    """AdamW weight decay."""
    use_lora: bool = True
    """Train a LoRA adapter, as the hosted service does. False trains every weight."""
    lora_rank: int = setting(16, at_least(1), at_most(4096, "LoRA ranks are tens to hundreds"))
    """LoRA rank r (with ``use_lora``)."""
    lora_alpha: int = setting(32, at_least(1))
    """LoRA scale: the adapter's update is multiplied by ``lora_alpha / lora_rank``."""
    lora_dropout: float = setting(0.0, holds(lambda v: 0 <= v < 1, IN_0_1))
    """Dropout on the LoRA input, in [0, 1)."""
    trainable_tokens: tuple[str, ...] = setting((), token_rows_with_lora)
    """With ``use_lora``: tokens, as the vocabulary spells them (``"<tool_call>"``), whose
    embedding and LM-head rows train in full beside the adapter. For special tokens the base
    model never trained, which LoRA cannot move (``docs/lora.md``). Checked against the
    tokenizer before the model loads."""


@dataclass(frozen=True)
class CheckpointSettings(Section):
    """Checkpoints and resume: the run's folder, its seed, when it saves, and how it
    continues. What a resumed run must keep (the seed among them) is in ``runs/directory.py``."""

    run_name: str | None = setting(None, folder_name)
    """Folder under ``runs_dir``. None: the loop names the run
    ``<loop>-<model>-<UTC timestamp>`` once, with ``with_resolved_run_name()``."""
    runs_dir: str = "runs"
    """Where run folders live: config.yaml, metrics.jsonl, rollouts, checkpoints, model."""
    seed: int = setting(0, at_least(0), at_most(2**63 - 1, "seeds are 64-bit"))
    """Seed of task (or conversation) order, sampling and initialisation."""
    checkpoint_interval: int = setting(10, at_least(0))
    """A training checkpoint every this many steps (and at the end). 0 = only the final
    one."""
    resume: bool = setting(False, resume_needs_run_name)
    """Continue ``runs_dir/run_name/`` from its newest checkpoint that reads back whole
    (``grpo/runs.py``: which one, what may change). Needs ``run_name``."""
    resume_allow_missing_files: bool = False
    """Resume a run that has checkpoints but lost its ``metrics.jsonl`` or ``config.yaml``
    (its history then starts at the checkpoint). Off: such a resume is refused, saying
    which file is gone (``grpo/run_checks.py``)."""


@dataclass(frozen=True)
class LoggingSettings(Section):
    """What the run reports, where and how often (metrics.jsonl is always written)."""

    wandb_project: str | None = "post-training-cookbook"
    """W&B project to log to (``WANDB_MODE=offline`` logs locally). None turns W&B off, and
    nothing of wandb is imported."""
    validation_interval: int = setting(10, at_least(0))
    """Steps between validations (GRPO: on ``val_tasks``; SFT: losses on
    ``val_conversations``, and one at the end). 0 = never (SFT: only at the end)."""


@dataclass(frozen=True)
class LimitSettings(Section):
    """Limits: the tokens an episode or conversation holds, and the memory a training step
    may take. The memory limits bound memory, not the result."""

    max_model_length: int = setting(2048, at_least(1))
    """Tokens per episode (prompt, every turn and tool results) or conversation. A GRPO turn
    that cannot fit ends the episode as ``CONTEXT_OVERFLOW``; a longer SFT conversation is
    skipped and counted, never cut."""
    micro_batch_tokens: int | None = setting(None, at_least(1, or_none=True))
    """Tokens per forward/backward micro-batch: of its stream when packed
    (``trainer_packing``), else padded (episodes under 3/4 of a micro-batch's longest go to
    another, so padding stays under a quarter). A longer episode gets one alone. None: 2048
    on a CPU (no slower a token than larger ones, and less memory), 8192 on a GPU, or less
    where that does not fit ``memory_budget``; a stream of episodes sharing a prompt may then
    grow to the largest micro-batch that fits (up to 8192), so that a group stays together
    (logged once; docs/performance.md)."""
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward instead of keeping them (one
    more decoder forward a step). None: on only where the default micro-batch's activations
    (2048 tokens on a CPU, 8192 on a GPU) would not fit ``memory_budget`` without it (the
    bundled model's always do); a stream of episodes sharing a prompt that holds more tokens
    than the padded rows of its episodes would at once then checkpoints just enough of its
    layers to keep about their memory. docs/models.md, Memory."""
    memory_budget: float = setting(
        0.5, holds(lambda v: 0 < v <= 1, "{name} must be in (0, 1], got {value}")
    )
    """Share of the device's free memory (after the weights load) that a training step may
    add, where ``micro_batch_tokens`` or ``gradient_checkpointing`` is None: the trained
    weights' gradients and AdamW moments, and one micro-batch's activations, autocast weight
    copies and log-probability chunk (on a CPU as the heap holds them;
    ``trainer/memory_plan.py``, docs/performance.md)."""
    logprob_chunk_tokens: int | Literal["auto"] | None = setting("auto", at_least(1, or_none=True))
    """Trained positions whose vocabulary-sized log-softmax exists at once; a micro-batch
    with more recomputes its LM head per chunk in backward. None: a micro-batch's all at
    once; ``"auto"``: as many as 64 MiB of fp32 logits hold, a power of two from 64 to
    1,024 (256 for a 49k vocabulary, 64 for Qwen's 152k; logged). Bounds memory, not the
    result."""


@dataclass(frozen=True)
class ScaleOutSettings(Section):
    """Where the trainer runs: in this process, or as Ray actors (extra ``scale``;
    docs/scale_out.md). GRPO's generators have settings of their own beside these."""

    backend: Backend = "local"
    """Where the trainer (and GRPO's generators) run: in this process, or as Ray actors."""
    ray_address: str | None = setting(None, only_when(on_ray, RAY_ADDRESS_NEEDS_RAY))
    """Ray cluster to join (``host:port``); None starts a local, loopback-only Ray."""
    num_gpus_per_trainer: float = setting(0.0, non_negative, gpus_on_ray)
    """Ray: GPUs reserved for each trainer worker (0: it computes on the CPU)."""
    num_trainer_workers: int = setting(
        1, at_least(1), at_most(4096, "one process a GPU"), sharded_trainer_on_ray
    )
    """Trainer processes (Ray; ``num_gpus_per_trainer`` each). More than 1 shards the model
    across them with FSDP2 and splits each batch between them (docs/scale_out.md)."""
    collective_timeout_s: float = setting(600.0, positive)
    """A sharded trainer's collective (its start included) that waits longer for a worker
    raises, instead of hanging on one that is gone."""
