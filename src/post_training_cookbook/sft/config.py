"""``SFTConfig``: every setting of a supervised fine-tuning run, validated when it is built.

Shaped like ``GRPOConfig`` and built with the same machinery (``grpo/validation.py``): each
field states its own rules beside it (``setting(default, *rules)``), every problem is raised
at once, the YAML round trip is the same, and the trainer fields mean what GRPO's do (the
same trainer and service train both). ``docs/sft.md`` shows the fields as a table.

Building a config never loads the model. This module imports neither torch nor wandb.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_type_hints

import yaml

from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.runs.config import (
    IN_0_1,
    RAY_ADDRESS_NEEDS_RAY,
    ConfigYamlLoader,
    Dtype,
    LRSchedule,
    admits_float,
    at_least,
    at_most,
    device_name,
    device_on_local,
    folder_name,
    gpus_on_ray,
    holds,
    is_int,
    matches,
    model_short_name,
    non_negative,
    on_ray,
    only_when,
    positive,
    raise_if_any,
    resume_needs_run_name,
    setting,
    sharded_trainer_on_ray,
    token_rows_with_lora,
    tuples_from_lists,
    type_problem,
    unknown_key,
    value_problems,
)
from post_training_cookbook.service.types import Backend
from post_training_cookbook.trainer.types import Precision

if TYPE_CHECKING:
    from collections.abc import Mapping
    from os import PathLike

__all__ = ["SFTConfig", "TrainOn"]

TrainOn = Literal["all", "last"]


def _warmup_fits(config: SFTConfig, name: str, value: int) -> str | None:
    if config.num_steps is None or value <= config.num_steps:
        return None
    return f"warmup_steps must be <= num_steps ({config.num_steps}), got {value}"


@dataclass(frozen=True)
class SFTConfig:
    """Every setting of an SFT run. Field table: docs/sft.md."""

    model: str = BUNDLED_MODEL_ID
    """A catalog id (``models.list_models()``) or a local Hugging Face folder."""
    codec: str | None = None
    """Codec that renders the conversations (``"hermes"`` ...; docs/models.md). None takes
    the catalog's, or infers it from a local folder's chat template."""
    train_on: TrainOn = "all"
    """Which assistant turns the loss covers: ``"all"`` of them, or only each
    conversation's ``"last"`` (earlier ones are context, as the prompt is)."""
    max_model_length: int = setting(2048, at_least(2))
    """Tokens per conversation. A longer one is skipped and counted, never cut."""
    batch_tokens: int = setting(16384, at_least(1))
    """Token budget of one optimizer step: conversations are added to a batch while their
    rendered lengths sum to at most this (one longer conversation gets a batch alone). The
    loss is the mean over the batch's trained tokens."""
    num_epochs: int = setting(1, at_least(1))
    """Passes over the training conversations (each shuffled with ``seed``)."""
    batch_by_prompt: bool = False
    """Each batch holds conversations of one prompt (the same tools and system message),
    so the trainer forwards that shared prefix once per batch instead of once per
    conversation (``trainer/packing.py``): with long tool docs this is most of the compute
    (5.2x fewer tokens on the BFCL multi-turn demonstrations). A batch then never mixes
    prompts: the order of prompts and of conversations within one is still shuffled."""
    num_steps: int | None = setting(None, at_least(1, or_none=True))
    """Optimizer steps; None: as many as ``num_epochs`` passes take. Set, it overrides
    ``num_epochs`` (the passes repeat as needed)."""
    learning_rate: float = setting(1e-4, positive)
    """Peak learning rate, reached after ``warmup_steps``, then shaped by ``lr_schedule``."""
    lr_schedule: LRSchedule = "cosine"
    """After warmup: ``"constant"``, or a ``"linear"`` / ``"cosine"`` decay to 0."""
    warmup_steps: int = setting(0, at_least(0), _warmup_fits)
    """Steps of linear warmup up to ``learning_rate``."""
    weight_decay: float = setting(0.0, non_negative)
    """AdamW weight decay."""
    max_grad_norm: float = setting(1.0, positive)
    """Gradients are clipped to this total norm."""
    wandb_project: str | None = "post-training-cookbook"
    """W&B project to log to (``WANDB_MODE=offline`` logs locally). None turns W&B off."""

    # Model and LoRA, as GRPOConfig's
    use_lora: bool = True
    """Train a LoRA adapter. False trains every weight."""
    lora_rank: int = setting(16, at_least(1), at_most(4096, "LoRA ranks are tens to hundreds"))
    """LoRA rank r (with ``use_lora``)."""
    lora_alpha: int = setting(32, at_least(1))
    """LoRA scale: the update is multiplied by ``lora_alpha / lora_rank``."""
    lora_dropout: float = setting(0.0, holds(lambda v: 0 <= v < 1, IN_0_1))
    """Dropout on the LoRA input, in [0, 1)."""
    trainable_tokens: tuple[str, ...] = setting((), token_rows_with_lora)
    """With ``use_lora``: tokens, as the vocabulary spells them (``"<tool_call>"``), whose
    embedding and LM-head rows train in full beside the adapter. For special tokens the base
    model never trained, which LoRA cannot move (``docs/lora.md``). Checked against the
    tokenizer before the model loads."""
    dtype: Dtype | None = None
    """The service's generator copy of the weights (unused by SFT itself; the final model
    is written from the trainer). None: the model's default."""

    # Trainer, as GRPOConfig's
    micro_batch_tokens: int = setting(8192, at_least(1))
    """Padded tokens per forward/backward micro-batch. Bounds memory, not the result."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    logprob_chunk_tokens: int | Literal["auto"] | None = setting("auto", at_least(1, or_none=True))
    """Trained positions whose vocabulary-sized log-softmax exists at once (None: all;
    ``"auto"``: sized by the vocabulary, as ``GRPOConfig``'s)."""
    trainer_precision: Precision = "fp32"
    """``"fp32"``, or ``"bf16"`` weights and gradients with fp32 masters in the optimizer."""
    device: str = setting("auto", device_name, device_on_local)
    """Where the trainer computes (``backend="local"``): ``"auto"``, ``"cpu"``, ``"cuda[:N]"``."""
    backend: Backend = "local"
    """In this process, or Ray actors (extra ``scale``; docs/scale_out.md)."""
    ray_address: str | None = setting(None, only_when(on_ray, RAY_ADDRESS_NEEDS_RAY))
    """Ray cluster to join; None starts a local, loopback-only Ray."""
    num_gpus_per_trainer: float = setting(0.0, non_negative, gpus_on_ray)
    """Ray: GPUs reserved for each trainer worker."""
    num_trainer_workers: int = setting(
        1, at_least(1), at_most(4096, "one process a GPU"), sharded_trainer_on_ray
    )
    """Ray: trainer processes; more than 1 shards the model with FSDP2."""
    collective_timeout_s: float = setting(600.0, positive)
    """A sharded trainer's collective that waits longer for a worker raises."""

    # Runs, checkpoints, validation
    run_name: str | None = setting(None, folder_name)
    """Folder under ``runs_dir``. None: ``sft-<model>-<UTC timestamp>``, fixed once."""
    runs_dir: str = "runs"
    """Where run folders live: config.yaml, metrics.jsonl, checkpoints, final_model."""
    seed: int = setting(0, at_least(0), at_most(2**63 - 1, "seeds are 64-bit"))
    """Seed of the conversation order and of initialisation (the LoRA adapter)."""
    checkpoint_interval: int = setting(50, at_least(0))
    """A training checkpoint every this many steps (and at the end). 0 = only the last."""
    resume: bool = setting(False, resume_needs_run_name)
    """Continue ``runs_dir/run_name/`` from its newest checkpoint that reads back whole."""
    resume_allow_missing_files: bool = False
    """Resume a run that has checkpoints but lost its ``metrics.jsonl`` or ``config.yaml``
    (its history then starts at the checkpoint). Off: such a resume is refused, saying
    which file is gone."""
    validation_interval: int = setting(50, at_least(0))
    """Steps between validation losses on ``val_conversations`` (and one at the end).
    0 = only at the end."""

    def __post_init__(self) -> None:
        tuples_from_lists(self, _field_types())
        for name, hint in _field_types().items():  # 1 where a float goes is stored as 1.0
            value = getattr(self, name)
            if is_int(value) and admits_float(hint):
                object.__setattr__(self, name, float(value))
        problems = [
            type_problem(name, hint, getattr(self, name))
            for name, hint in _field_types().items()
            if not matches(getattr(self, name), hint)
        ]
        raise_if_any(problems, "SFTConfig")
        raise_if_any(value_problems(self), "SFTConfig")

    def resolved_run_name(self, now: datetime | None = None) -> str:
        if self.run_name is not None:
            return self.run_name
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
        return f"sft-{model_short_name(self.model)}-{stamp}"

    def with_resolved_run_name(self, now: datetime | None = None) -> SFTConfig:
        """This config with ``run_name`` fixed, as written to config.yaml."""
        if self.run_name is not None:
            return self
        return replace(self, run_name=self.resolved_run_name(now))

    def run_dir(self) -> Path:
        if self.run_name is None:
            raise ValueError("run_dir() needs a run_name: call with_resolved_run_name() once")
        return Path(self.runs_dir) / self.run_name

    def to_dict(self) -> dict[str, Any]:
        return {  # tuples as lists: what safe_dump writes and YAML gives back
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in fields(self)
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SFTConfig:
        """A config from field values; an unknown key or a wrong type raises ``ValueError``."""
        from collections.abc import Mapping

        if not isinstance(data, Mapping):
            raise ValueError(f"an SFTConfig is a mapping of field names, got {type(data)}")
        names = [f.name for f in fields(cls)]
        raise_if_any(
            [unknown_key(key, names, "SFTConfig") for key in data if key not in names],
            "SFTConfig",
        )
        return cls(**data)

    def to_yaml(self, path: str | PathLike[str]) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        target.write_text(
            "# SFTConfig: load with SFTConfig.from_yaml; fields in docs/sft.md\n" + body
        )
        return target

    @classmethod
    def from_yaml(cls, path: str | PathLike[str]) -> SFTConfig:
        """Load a config; ``ValueError`` names the file and the bad key."""
        source = Path(path)
        try:
            data = yaml.load(source.read_text(), Loader=ConfigYamlLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"{source}: not valid YAML: {exc}") from exc
        try:
            return cls.from_dict({} if data is None else data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc


@cache
def _field_types() -> dict[str, Any]:
    return get_type_hints(SFTConfig)
