"""A trainer is built from its model and one ``TrainerSettings``: ``Trainer(model, settings)``."""

from __future__ import annotations

import inspect
import math
from dataclasses import fields

import pytest

from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.runs.reporting import training_metrics
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    RouterCounts,
    TrainerSettings,
    TrainingSample,
)

MAX_INIT_LINES = 40


def test_the_trainer_constructor_stays_under_forty_lines() -> None:
    lines = inspect.getsource(Trainer.__init__).splitlines()
    assert len(lines) < MAX_INIT_LINES, f"Trainer.__init__ has {len(lines)} lines"


def test_the_trainer_takes_its_model_and_settings_and_only_two_collaborators() -> None:
    parameters = list(inspect.signature(Trainer.__init__).parameters.values())
    assert [p.name for p in parameters] == ["self", "model", "settings", "tokenizer", "group"]
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters[3:])


def test_settings_are_frozen_and_every_field_documented_once_in_the_type() -> None:
    settings = TrainerSettings()
    with pytest.raises(AttributeError):
        settings.use_lora = False  # type: ignore[misc]
    assert len({f.name for f in fields(TrainerSettings)}) == len(fields(TrainerSettings))


def test_a_trainer_built_from_settings_on_the_bundled_model_takes_a_step() -> None:
    settings = TrainerSettings(use_lora=False, seed=0, device="cpu", autocast_bf16=False)
    trainer = Trainer(resolve_model(BUNDLED_MODEL_ID).source, settings)
    assert trainer.settings is settings and trainer.version == 0
    assert not trainer.use_lora and trainer.precision == "fp32"
    tokens = [1, 5, 9, 12, 7, 30, 31, 32]
    mask = [0.0] * 4 + [1.0] * 4
    samples = [
        TrainingSample(tokens, mask, [-2.0 * m for m in mask], [advantage * m for m in mask])
        for advantage in (1.0, -1.0)
    ]
    result = trainer.forward_backward(samples, LossConfig())
    step = trainer.optim_step(1e-4)
    assert math.isfinite(result.loss) and result.num_tokens == 8 and result.router is None
    assert all(key.startswith("loss/") for key in result.metrics)  # means only, no counts
    assert not step.skipped and step.version == trainer.version == 1
    assert math.isfinite(step.grad_norm) and step.grad_norm > 0


def test_a_training_call_logs_its_counts_from_typed_fields_under_the_same_names() -> None:
    result = ForwardBackwardResult(
        loss=0.5, metrics={"loss/entropy": 2.0}, num_tokens=6, forwarded_tokens=40,
        router=RouterCounts(replayed_tokens=8, routed_otherwise=2),
    )  # fmt: skip
    step = OptimStepResult(version=3, grad_norm=0.25, skipped=False, learning_rate=1e-4)
    assert training_metrics(result, step) == {
        "loss/entropy": 2.0,
        "optim/grad_norm": 0.25,
        "optim/learning_rate": 1e-4,
        "optim/skipped": 0.0,
        "train/forwarded_tokens": 40.0,
        "router/disagreement": 0.25,
        "router/replayed_tokens": 8.0,
    }
    without_replay = training_metrics(ForwardBackwardResult(0.5), step)
    assert not any(key.startswith("router/") for key in without_replay)
