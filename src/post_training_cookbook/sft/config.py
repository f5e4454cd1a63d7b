"""``SFTConfig``: every setting of a supervised fine-tuning run, validated when it is built.

Composed as ``GRPOConfig`` is (``runs/composed.py``): the shared sections, defined once in
``runs/sections.py`` and given SFT's defaults here, beside SFT's own four fields. Every
problem is raised at once, the YAML round trip is the same (nested, flat keys of before
warned), and the trainer fields mean what GRPO's do (the same trainer and service train
both). ``docs/sft.md`` shows the fields as a table.

Building a config never loads the model. This module imports neither torch nor wandb.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from post_training_cookbook.runs.composed import ComposedConfig, compose
from post_training_cookbook.runs.config import at_least, setting
from post_training_cookbook.runs.sections import (
    CheckpointSettings,
    LimitSettings,
    LoggingSettings,
    ModelSettings,
    OptimizerSettings,
    ScaleOutSettings,
    section,
)

__all__ = ["SFTConfig", "TrainOn"]

TrainOn = Literal["all", "last"]


@compose
@dataclass(frozen=True)
class SFTConfig(ComposedConfig):
    """Every setting of an SFT run: the sections every loop's config holds
    (``runs/sections.py``; no sampling), with SFT's defaults, then SFT's own fields. Flat
    names reach a section's field as ``GRPOConfig``'s do. Field table: docs/sft.md."""

    config_name: ClassVar[str] = "SFTConfig"
    run_name_prefix: ClassVar[str] = "sft"
    docs: ClassVar[str] = "fields in docs/sft.md"

    base: ModelSettings = section(ModelSettings())
    """Model and precision: ``model``, ``codec``, ``dtype``, ``device``,
    ``trainer_precision``."""
    optimizer: OptimizerSettings = section(
        OptimizerSettings(learning_rate=1e-4, lr_schedule="cosine", num_steps=None)
    )
    """Optimiser and schedule; ``num_steps`` None: as many as ``num_epochs`` take."""
    checkpoints: CheckpointSettings = section(CheckpointSettings(checkpoint_interval=50))
    """The run's folder, seed, checkpoints and resume."""
    logging: LoggingSettings = section(LoggingSettings(validation_interval=50))
    """``wandb_project``, ``validation_interval`` (and a validation at the end)."""
    limits: LimitSettings = section(
        LimitSettings(micro_batch_tokens=8192, gradient_checkpointing=False)
    )
    """``max_model_length`` (a longer conversation is skipped and counted, never cut) and a
    training step's memory limits."""
    scale_out: ScaleOutSettings = section(ScaleOutSettings())
    """The trainer's backend, Ray and workers."""

    train_on: TrainOn = "all"
    """Which assistant turns the loss covers: ``"all"`` of them, or only each
    conversation's ``"last"`` (earlier ones are context, as the prompt is)."""
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

    def __post_init__(self) -> None:
        self.validate(self._own_problems)

    def _own_problems(self) -> list[str]:
        length = self.max_model_length
        if length < 2:  # a conversation needs a prompt token and a trained one
            return [f"limits.max_model_length must be >= 2, got {length}"]
        return []
