"""Supervised fine-tuning (``train_sft``): a run from the call to the final model, on the same
trainer service as GRPO.

1. Checks that need no weights: the config, the model's catalog entry, every conversation
   (``SFTDataError`` names file and line). Then the codec renders them, longer ones skipped
   and counted; still before any weights load.
2. The service (``open_service``: LoRA or full, bf16 masters, gradient checkpointing,
   chunked log-probabilities, sharded workers on Ray); a resumed run loads its newest
   readable checkpoint; only then the run folder (config.yaml) and W&B, as GRPO does
   (``runs/opening.py``).
3. The loop: each step's conversations (``plan_batches``, fixed by the data and the seed),
   one ``forward_backward`` with the ``"sft"`` loss (mean NLL over the batch's trained
   tokens), one ``optim_step``; the validation loss every ``validation_interval`` steps;
   atomic checkpoints every ``checkpoint_interval``. A scheduler's SIGTERM stops it after
   the step it is in, saved (``runs/stopping.py``); a full disk while it saves, with
   ``DiskFullError`` (``runs/saving.py``).
4. The final validation loss and the final model (``runs/<run_name>/final_model``).

Padding-free packing of short conversations into one row is not built yet: each
conversation is its own row of a micro-batch. The loss is normalised by the trained tokens
of the whole optimizer batch, so packing, when it comes, changes speed, not the loss.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from post_training_cookbook.files import write_text_atomic
from post_training_cookbook.models.availability import require_weights
from post_training_cookbook.models.catalog import (
    ModelInfo,
    check_model_can_sample,
    require_engine_support,
    resolve_model,
)
from post_training_cookbook.models.loading import load_codec
from post_training_cookbook.runs.config import LearningRateSchedule
from post_training_cookbook.runs.directory import LoopState, RunDirectory
from post_training_cookbook.runs.models import trainer_settings
from post_training_cookbook.runs.opening import claim_run_folder, open_run_folder
from post_training_cookbook.runs.reporting import training_metrics
from post_training_cookbook.runs.saving import checkpoint_step, save_final_model
from post_training_cookbook.runs.stopping import StopRequest, stop_on_sigterm
from post_training_cookbook.service.base import ModelService
from post_training_cookbook.service.factory import ServiceSpec, check_service_spec, open_service
from post_training_cookbook.sft.config import SFTConfig
from post_training_cookbook.sft.conversations import Conversation, load_conversations
from post_training_cookbook.sft.data import RenderedData, SFTExample, plan_batches, render_examples
from post_training_cookbook.sync import run_sync
from post_training_cookbook.trainer.types import SFT_LOSS, LossConfig

Conversations = str | Path | Iterable[Conversation | Mapping[str, Any]]
DATA_SUMMARY = "data.json"
"""In the run folder: how many conversations were trained on, and which were skipped."""


class SFTRunDirectory(RunDirectory):
    """The run folder every loop writes, with an ``SFTConfig`` in config.yaml (rollouts/
    stays empty)."""

    config_type = SFTConfig


def train_sft(
    config: SFTConfig,
    conversations: Conversations,
    val_conversations: Conversations | None = None,
) -> RunDirectory:
    """Fine-tune ``config.model`` on ``conversations`` (a JSONL path, or ``Conversation``s or
    ``{"messages", "tools"}`` mappings), the loss on the assistant's tokens.

    Returns the run directory (``runs/<run_name>``: config.yaml, metrics.jsonl, data.json,
    checkpoints/, final_model/). ``val_conversations``: the validation loss ``val/nll``,
    before step 0, every ``validation_interval`` steps and at the end. Bad data or config
    fails before any model loads. Callable from sync code, also inside a running event loop.
    A SIGTERM while it trains stops the run after the step it is in, saved, with
    ``TrainingStopped``.
    """
    train = load_conversations(conversations)
    val = load_conversations(val_conversations) if val_conversations is not None else []
    config = config.with_resolved_run_name()
    info = resolve_model(config.model, codec=config.codec)
    check_model_can_sample(info, config.max_model_length)
    require_weights(info)
    spec = service_spec(config, info)
    require_engine_support(info, spec.generation_engine)
    check_service_spec(spec)
    codec = load_codec(info)
    train_data = render_examples(codec, train, config.train_on, config.max_model_length)
    val_data = render_examples(codec, val, config.train_on, config.max_model_length)
    if not train_data.examples:
        raise ValueError(
            f"no training conversation fits max_model_length={config.max_model_length} with "
            f"a token to train on ({len(train_data.skipped_too_long)} too long, "
            f"{len(train_data.skipped_untrained)} without an assistant turn)"
        )
    with stop_on_sigterm() as stop:
        return run_sync(_train(config, spec, train_data, val_data, stop))


def service_spec(config: SFTConfig, info: ModelInfo) -> ServiceSpec:
    """The run's service: GRPO's, with the one generator the service always holds."""
    return ServiceSpec(
        model=info,
        trainer=trainer_settings(config),
        backend=config.backend,
        generation_engine="torch" if "torch" in info.engines else "vllm",
        engine_dtype=config.dtype,
        max_model_length=config.max_model_length,
        ray_address=config.ray_address,
        device=config.device,
        num_gpus_per_trainer=config.num_gpus_per_trainer,
        num_trainer_workers=config.num_trainer_workers,
        collective_timeout_s=config.collective_timeout_s,
    )


async def _train(
    config: SFTConfig, spec: ServiceSpec, train: RenderedData, val: RenderedData, stop: StopRequest
) -> RunDirectory:
    directory = claim_run_folder(SFTRunDirectory, config)
    examples = train.examples
    plan = plan_batches(
        [len(example.tokens) for example in examples],
        config.batch_tokens, config.num_epochs, config.num_steps, config.seed,
        [example.prompt for example in examples] if config.batch_by_prompt else None,
    )  # fmt: skip
    schedule = LearningRateSchedule(
        config.learning_rate, len(plan), config.warmup_steps, config.lr_schedule
    )
    loss = LossConfig(loss_type=SFT_LOSS)
    val_samples = [example.training_sample() for example in val.examples]
    async with contextlib.AsyncExitStack() as opened:
        service = await open_service(spec)
        opened.push_async_callback(service.close)
        log, resumed = await open_run_folder(opened, directory, config, service, len(plan))
        for note in _write_data_summary(directory, train, val, len(plan)):
            log.note(note)
        start = resumed.step if resumed else 0
        name = config.resolved_run_name()
        stop.check_before_training(start)
        for step in range(start, len(plan)):
            metrics: dict[str, float] = {}
            if val_samples and _validation_due(config, step):
                metrics["val/nll"] = await validation_loss(service, val_samples)
            started = time.perf_counter()
            batch = [examples[index] for index in plan[step]]
            result = await service.forward_backward(
                [example.training_sample() for example in batch], loss
            )
            optimized = await service.optim_step(schedule.at(step))
            metrics.update(training_metrics(result, optimized) | _batch_metrics(batch))
            metrics.update({"time/train": time.perf_counter() - started})
            metrics["train/epoch"] = _epoch_of(plan, step, len(examples))
            log.record(step, metrics)
            due = step + 1 == len(plan) or (
                config.checkpoint_interval > 0 and (step + 1) % config.checkpoint_interval == 0
            )
            state = LoopState(step + 1, step + 1, name)
            await checkpoint_step(directory, service, state, due=due, stop=stop)
        if val_samples:
            final = {"val/nll": await validation_loss(service, val_samples)}
            log.record(len(plan), final, advance=False)
        await save_final_model(directory, service)
        log.note(f"final model: {directory.final_model_dir}")
    return directory


async def validation_loss(service: ModelService, samples: Sequence[Any]) -> float:
    """Mean NLL over the trained tokens of ``samples`` under the current weights."""
    logprobs = await service.forward(samples)
    total = sum(-lp for row in logprobs for lp in row)
    tokens = sum(sample.num_trained_tokens for sample in samples)
    return total / max(tokens, 1)


def _validation_due(config: SFTConfig, step: int) -> bool:
    return config.validation_interval > 0 and step % config.validation_interval == 0


def _batch_metrics(batch: list[SFTExample]) -> dict[str, float]:
    return {
        "train/conversations": float(len(batch)),
        "train/trained_tokens": float(sum(sum(example.mask) for example in batch)),
        "train/tokens": float(sum(len(example.tokens) for example in batch)),
    }


def _epoch_of(plan: list[list[int]], step: int, num_examples: int) -> float:
    """Passes over the data completed after ``step`` (fractional)."""
    seen = sum(len(batch) for batch in plan[: step + 1])
    return seen / max(num_examples, 1)


def _write_data_summary(
    directory: RunDirectory, train: RenderedData, val: RenderedData, num_steps: int
) -> list[str]:
    """data.json, and a note for each kind of skipped conversation and for the message
    keys dropped."""
    summary = {
        "num_steps": num_steps,
        "train_conversations": len(train.examples),
        "train_trained_tokens": sum(sum(example.mask) for example in train.examples),
        "val_conversations": len(val.examples),
        "skipped_too_long": train.skipped_too_long + val.skipped_too_long,
        "skipped_untrained": train.skipped_untrained + val.skipped_untrained,
        "ignored_message_keys": dict(train.ignored_keys + val.ignored_keys),
    }
    write_text_atomic(directory.path / DATA_SUMMARY, json.dumps(summary, indent=1) + "\n")
    notes = []
    for key, why in (
        ("skipped_too_long", "longer than max_model_length (not cut)"),
        ("skipped_untrained", "without an assistant token to train on"),
    ):
        skipped: list[str] = summary[key]  # type: ignore[assignment]
        if skipped:
            shown = ", ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else "")
            notes.append(f"data: skipped {len(skipped)} conversation(s) {why}: {shown}")
    ignored: dict[str, int] = summary["ignored_message_keys"]  # type: ignore[assignment]
    if ignored:
        counts = ", ".join(f"{key!r} in {count}" for key, count in sorted(ignored.items()))
        notes.append(f"data: dropped message keys no codec renders ({counts} message(s))")
    return notes
