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


def plan(model: object, device: torch.device = CPU) -> memory_plan.MemoryPlan:
    return plan_memory(model, device, memory_budget=0.5, micro_batch_tokens=None,  # type: ignore[arg-type]
                       gradient_checkpointing=None, activation_bytes=4)  # fmt: skip


def test_plenty_of_memory_takes_the_device_s_micro_batch_without_checkpointing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_free(monkeypatch, 2**40)
    on_cpu, on_gpu = plan(tiny_model("llama")), plan(tiny_model("llama"), torch.device("cuda"))
    # A CPU is no faster a token past 2k tokens; a stream sharing a prefix may grow to 8k.
    assert (on_cpu.micro_batch_tokens, on_cpu.shared_stream_tokens) == (2048, 8192)
    assert (on_gpu.micro_batch_tokens, on_gpu.shared_stream_tokens) == (8192, 8192)
    assert not on_cpu.gradient_checkpointing and not on_gpu.gradient_checkpointing


def test_little_memory_turns_checkpointing_on_then_shrinks_the_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    full, checkpointed = (activation_bytes_per_token(model, c, 4) for c in (False, True))
    with_free(monkeypatch, 2 * 4096 * full)  # 4096 tokens fit without checkpointing
    on_cpu, on_gpu = plan(model), plan(model, torch.device("cuda"))
    assert not on_cpu.gradient_checkpointing  # the CPU's 2048 fit
    assert (on_cpu.micro_batch_tokens, on_cpu.shared_stream_tokens) == (2048, 4096)
    assert on_gpu.gradient_checkpointing  # the GPU's 8192 do not
    expected = min(8192, 4096 * full // checkpointed)
    assert on_gpu.micro_batch_tokens == on_gpu.shared_stream_tokens == expected
    with_free(monkeypatch, 1000)
    tight = plan(model)
    assert (tight.micro_batch_tokens, tight.gradient_checkpointing) == (256, True)  # the floor
    assert tight.shared_stream_tokens == 256


def test_explicit_fields_win_and_the_plan_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_free(monkeypatch, 1000)
    with caplog.at_level(logging.INFO, logger="post_training_cookbook.trainer.memory_plan"):
        trainer = Trainer(tiny_model("qwen2"), use_lora=True, micro_batch_tokens=300,
                          gradient_checkpointing=None, autocast_bf16=False)  # fmt: skip
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (300, True)
    assert trainer.shared_stream_tokens == 300  # a given micro-batch bounds streams too
    messages = [r.getMessage() for r in caplog.records if r.name.endswith("memory_plan")]
    assert len(messages) == 1 and "micro_batch_tokens=300 (as set)" in messages[0]
    trainer = Trainer(tiny_model("qwen2"), use_lora=True, micro_batch_tokens=None,
                      gradient_checkpointing=False, autocast_bf16=False)  # fmt: skip
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (256, False)


def test_a_memory_budget_outside_0_1_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        Trainer("/nonexistent", use_lora=True, memory_budget=1.5)
