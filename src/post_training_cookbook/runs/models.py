"""A model to load from a name: a catalog id, a local Hugging Face folder, or a run's weights
(what ``evaluate`` scores, a teacher or the policy server loads).

A run directory (``runs/<run_name>``, with its ``config.yaml``) gives its ``final_model``, or
with ``step=N`` its training checkpoint ``checkpoints/step_<N>``. A checkpoint folder can
also be named directly. A training checkpoint holds only the trainable weights (the LoRA
adapter, or every weight), so it is applied to the base model named in the run's
``config.yaml`` (read with the config class of the loop that wrote it, which the caller
hands in: ``config_type``, else the package's default, ``runs/__init__.py``) and sampled
with merged weights, once its files match the sha256 its ``manifest.json`` lists (as on
resume). Both keep the base model's catalog entry (codec, codec options, default dtype), so
a run's model renders prompts exactly as the run did.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from post_training_cookbook.models.catalog import ModelInfo, resolve_model
from post_training_cookbook.runs import default_config_type
from post_training_cookbook.runs.checks import check_manifest
from post_training_cookbook.runs.config import model_short_name
from post_training_cookbook.trainer.types import Precision, TrainerSettings

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from transformers import PreTrainedModel

CHECKPOINT_MARKER = "trainer_state.json"


class TrainerConfig(Protocol):
    """What every loop's config says of its trainer (``GRPOConfig``'s, ``SFTConfig``'s)."""

    @property
    def use_lora(self) -> bool: ...

    @property
    def lora_rank(self) -> int: ...

    @property
    def lora_alpha(self) -> int: ...

    @property
    def lora_dropout(self) -> float: ...

    @property
    def trainable_tokens(self) -> tuple[str, ...]: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def max_grad_norm(self) -> float | None: ...

    @property
    def micro_batch_tokens(self) -> int | None: ...

    @property
    def gradient_checkpointing(self) -> bool | None: ...

    @property
    def memory_budget(self) -> float: ...

    @property
    def logprob_chunk_tokens(self) -> int | Literal["auto"] | None: ...

    @property
    def trainer_precision(self) -> Precision: ...

    @property
    def seed(self) -> int | None: ...


class RunModelConfig(TrainerConfig, Protocol):
    """What loading a run's weights needs of the config in its config.yaml (``GRPOConfig``'s)."""

    @property
    def model(self) -> str: ...

    @property
    def codec(self) -> str | None: ...

    @property
    def dtype(self) -> Any: ...

    def codec_options(self) -> dict[str, object]: ...


def trainer_settings(config: TrainerConfig, **loop_options: Any) -> TrainerSettings:
    """The trainer a loop's config asks for: the fields every loop's config has (LoRA,
    optimizer, memory limits, ``trainer_precision`` as ``precision``, seed) and the loop's own
    (``loop_options``: GRPO's KL reference, packing, router replay)."""
    return TrainerSettings(
        use_lora=config.use_lora,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        trainable_tokens=config.trainable_tokens,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        micro_batch_tokens=config.micro_batch_tokens,
        gradient_checkpointing=config.gradient_checkpointing,
        memory_budget=config.memory_budget,
        logprob_chunk_tokens=config.logprob_chunk_tokens,
        precision=config.trainer_precision,
        seed=config.seed,
        **loop_options,
    )


@dataclass(frozen=True)
class EvalModel:
    name: str
    """Short and folder-safe: ``tool-use-tiny``, ``<run_name>``, ``<run_name>-step2``."""
    info: ModelInfo
    """The catalog entry (codec, context, dtype); for a run, its base model's."""
    weights_dir: Path | None = None
    """A run's ``final_model``: loaded instead of ``info.source``'s weights."""
    checkpoint: Path | None = None
    """A training checkpoint applied on top of ``info.source``'s weights."""
    run_config: RunModelConfig | None = None
    """The run's config, when the model comes from a run directory."""

    @property
    def weights_info(self) -> ModelInfo:
        if self.weights_dir is None:
            return self.info
        return replace(self.info, model_id=str(self.weights_dir), source=str(self.weights_dir))

    @property
    def tokenizer_info(self) -> ModelInfo:
        """The final model's folder when it holds a tokenizer (it does when the base had one)."""
        if self.weights_dir is not None and (self.weights_dir / "tokenizer_config.json").is_file():
            return self.weights_info
        return self.info

    @property
    def source(self) -> str:
        """Where the weights come from, for reports."""
        return str(self.checkpoint or self.weights_dir or self.info.source)

    @property
    def dtype(self) -> str:
        """The run's dtype, or the model's default (float32 for the bundled model)."""
        if self.run_config is not None and self.run_config.dtype is not None:
            return self.run_config.dtype
        return self.info.default_dtype


def resolve_eval_model(
    model: str | os.PathLike[str],
    *,
    step: int | None = None,
    codec: str | None = None,
    config_type: Any = None,
) -> EvalModel:
    """Decide what to load from metadata alone; ``ValueError`` says what is wrong.
    ``config_type``: the config class whose ``from_yaml`` reads a run's config.yaml (None:
    the package's default, GRPO's; ``runs/__init__.py``)."""
    path = Path(model).expanduser()
    if (path / CHECKPOINT_MARKER).is_file():
        if step is not None:
            raise ValueError(f"{path} is a checkpoint folder already: drop step={step}")
        return _from_checkpoint(path, codec, config_type)
    if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        return _from_run(path, step, codec, config_type)
    if step is not None:
        raise ValueError(
            f"step={step} needs a run directory (a folder with config.yaml), got {str(model)!r}"
        )
    info = resolve_model(str(model), codec=codec)
    return EvalModel(model_short_name(info.model_id), info)


def load_eval_weights(model: EvalModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The weights to sample with, in ``dtype`` (default fp32), a training checkpoint
    merged in."""
    import torch

    from post_training_cookbook.models.loading import load_model

    weights = load_model(model.weights_info, dtype or torch.float32)
    if model.checkpoint is not None:
        weights.load_state_dict(_checkpoint_weights(model), strict=False)
    return weights


def _checkpoint_weights(model: EvalModel) -> dict[str, Tensor]:
    """The checkpoint's trainable weights; ``BadFileError`` naming a file whose bytes are not
    those its manifest lists (garbled in place, same size), as on resume."""
    from post_training_cookbook.trainer.trainer import Trainer

    assert model.checkpoint is not None and model.run_config is not None
    check_manifest(model.checkpoint)
    config = model.run_config
    settings = replace(trainer_settings(config), autocast_bf16=False, device="cpu")
    trainer = Trainer(model.info.source, settings)
    trainer.load_training_checkpoint(model.checkpoint, load_optimizer=False)
    return dict(trainer.state_dict_for_inference())


def _from_run(run: Path, step: int | None, codec: str | None, config_type: Any) -> EvalModel:
    config, base = _run_base(run, codec, config_type)
    if step is not None:
        checkpoint = run / "checkpoints" / f"step_{step:06d}"
        if not (checkpoint / CHECKPOINT_MARKER).is_file():
            raise ValueError(f"run {run} has no checkpoint for step {step}; {_steps_note(run)}")
        return EvalModel(f"{run.name}-step{step}", base, checkpoint=checkpoint, run_config=config)
    final = run / "final_model"
    if not (final / "config.json").is_file():
        raise ValueError(
            f"run {run} has no final_model yet (still training, or stopped early): "
            f"pass a step; {_steps_note(run)}"
        )
    resolve_model(str(final), codec=codec or config.codec)  # its files read back (BadFileError)
    return EvalModel(run.name, base, weights_dir=final, run_config=config)


def _from_checkpoint(checkpoint: Path, codec: str | None, config_type: Any) -> EvalModel:
    run = checkpoint.resolve().parent.parent
    if not (run / "config.yaml").is_file():
        raise ValueError(
            f"{checkpoint} is a training checkpoint outside a run directory: its base model "
            f"is named in the run's config.yaml, expected at {run / 'config.yaml'}"
        )
    config, base = _run_base(run, codec, config_type)
    match = re.fullmatch(r"step_(\d+)", checkpoint.name)
    suffix = f"-step{int(match.group(1))}" if match else f"-{checkpoint.name}"
    return EvalModel(
        model_short_name(run.name) + suffix, base, checkpoint=checkpoint, run_config=config
    )


def _run_base(run: Path, codec: str | None, config_type: Any) -> tuple[RunModelConfig, ModelInfo]:
    if config_type is None:
        config_type = default_config_type()
    if config_type is None:
        raise ValueError(
            f"{run} is a run folder: its config.yaml needs the config class of the loop that "
            "wrote it (config_type=GRPOConfig, for instance)"
        )
    config: RunModelConfig = config_type.from_yaml(run / "config.yaml")
    return config, resolve_model(config.model, codec=codec or config.codec)


def _steps_note(run: Path) -> str:
    folder = run / "checkpoints"
    steps = sorted(
        int(match.group(1))
        for path in (folder.iterdir() if folder.is_dir() else [])
        if (match := re.fullmatch(r"step_(\d+)", path.name))
        and (path / CHECKPOINT_MARKER).is_file()
    )
    return f"checkpoints: {', '.join(map(str, steps))}" if steps else "it has no checkpoints"
