"""The memory plan: micro-batch size and gradient checkpointing chosen from the model's
shape and the free memory, where the settings leave them None (``trainer/memory_plan.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_trainer_packing import tiny_model

from post_training_cookbook.trainer import memory_plan
from post_training_cookbook.trainer.memory_plan import activation_bytes_per_token, plan_memory
from post_training_cookbook.trainer.trainer import Trainer

CPU = torch.device("cpu")


def with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(memory_plan, "free_bytes", lambda device: free)


def test_checkpointing_keeps_less_than_every_layer_does() -> None:
    model = tiny_model("llama")
    full = activation_bytes_per_token(model, False, 4)
    assert activation_bytes_per_token(model, True, 4) < full
    assert activation_bytes_per_token(model, False, 2) < full


def test_plenty_of_memory_keeps_the_largest_micro_batch_without_checkpointing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_free(monkeypatch, 2**40)
    plan = plan_memory(tiny_model("llama"), CPU, memory_budget=0.5, micro_batch_tokens=None,
                       gradient_checkpointing=None, activation_bytes=4)  # fmt: skip
    assert (plan.micro_batch_tokens, plan.gradient_checkpointing) == (8192, False)


def test_little_memory_turns_checkpointing_on_then_shrinks_the_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    full, checkpointed = (activation_bytes_per_token(model, c, 4) for c in (False, True))
    with_free(monkeypatch, 2 * 4096 * full)  # half of 8192 tokens fit without checkpointing
    plan = plan_memory(model, CPU, memory_budget=0.5, micro_batch_tokens=None,
                       gradient_checkpointing=None, activation_bytes=4)  # fmt: skip
    assert plan.gradient_checkpointing
    assert plan.micro_batch_tokens == min(8192, 4096 * full // checkpointed)
    with_free(monkeypatch, 1000)
    plan = plan_memory(model, CPU, memory_budget=0.5, micro_batch_tokens=None,
                       gradient_checkpointing=None, activation_bytes=4)  # fmt: skip
    assert (plan.micro_batch_tokens, plan.gradient_checkpointing) == (256, True)  # the floor


def test_explicit_fields_win_and_the_plan_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_free(monkeypatch, 1000)
    with caplog.at_level(logging.INFO, logger="post_training_cookbook.trainer.memory_plan"):
        trainer = Trainer(tiny_model("qwen2"), use_lora=True, micro_batch_tokens=300,
                          gradient_checkpointing=None, autocast_bf16=False)  # fmt: skip
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (300, True)
    messages = [r.getMessage() for r in caplog.records if r.name.endswith("memory_plan")]
    assert len(messages) == 1 and "micro_batch_tokens=300 (as set)" in messages[0]
    trainer = Trainer(tiny_model("qwen2"), use_lora=True, micro_batch_tokens=None,
                      gradient_checkpointing=False, autocast_bf16=False)  # fmt: skip
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (256, False)


def test_a_memory_budget_outside_0_1_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        Trainer("/nonexistent", use_lora=True, memory_budget=1.5)
