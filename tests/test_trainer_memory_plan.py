"""The memory plan: micro-batch size and gradient checkpointing chosen from the model's
shape and the free memory, where the settings leave them None (``trainer/memory_plan.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from test_trainer_packing import shaped_groups, tiny_model

from post_training_cookbook.trainer import memory_plan
from post_training_cookbook.trainer.memory_plan import (
    activation_bytes_per_token,
    layers_to_checkpoint,
    plan_memory,
)
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig

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
    messages = [  # (the log-probability chunk is said apart)
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("memory_plan") and "micro_batch_tokens" in r.getMessage()
    ]
    assert len(messages) == 1 and "micro_batch_tokens=300 (as set)" in messages[0]
    trainer = Trainer(tiny_model("qwen2"), use_lora=True, micro_batch_tokens=None,
                      gradient_checkpointing=False, autocast_bf16=False)  # fmt: skip
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (256, False)


def test_a_memory_budget_outside_0_1_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        Trainer("/nonexistent", use_lora=True, memory_budget=1.5)


def test_layers_to_checkpoint_keep_a_stream_near_the_target_s_activations() -> None:
    assert layers_to_checkpoint(30, 2048, 2048) == 0
    assert layers_to_checkpoint(30, 3152, 2048) == 15  # ceil(30 · (1 - 2048 / 3782.4)) + 1
    assert layers_to_checkpoint(30, 10**6, 2048) == 30


def four_layers() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_planned_stream_past_the_target_checkpoints_some_layers_with_the_same_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's stream kept whole past ``micro_batch_tokens`` (the plan's bound) runs its
    first layers checkpointed, each forwarded again in backward; the update is the plain
    path's."""
    with_free(monkeypatch, 2**40)
    monkeypatch.setattr(memory_plan, "CPU_MICRO_BATCH_TOKENS", 300)  # below one group's stream
    samples = shaped_groups(groups=2, episodes=4, prompt=120, added=40)  # streams of 280
    planned = Trainer(four_layers(), use_lora=True, micro_batch_tokens=None,
                      gradient_checkpointing=None, autocast_bf16=False, seed=0)  # fmt: skip
    assert (planned.micro_batch_tokens, planned.gradient_checkpointing) == (300, False)
    calls: list[int] = []
    layers = planned._stream_checkpointing.layers  # type: ignore[union-attr]
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, i=index: calls.append(i))
    planned_result = planned.forward_backward(samples, LossConfig())
    grads = {n: p.grad.clone() for n, p in planned.trainable_parameters().items()}
    # Two streams of 280 would be one of 560 past the target of 300: each group alone, and
    # no layer checkpointed (both within it).
    assert calls == [0, 1, 2, 3] * 2 and all(not layer.gradient_checkpointing for layer in layers)
    monkeypatch.setattr(memory_plan, "CPU_MICRO_BATCH_TOKENS", 256)  # now each stream is past it
    calls.clear()
    tight = Trainer(four_layers(), use_lora=True,
                    micro_batch_tokens=None, gradient_checkpointing=None, autocast_bf16=False,
                    seed=0)  # fmt: skip
    assert tight.micro_batch_tokens == 256 and tight.shared_stream_tokens > 280
    for index, layer in enumerate(tight._stream_checkpointing.layers):  # type: ignore[union-attr]
        layer.register_forward_pre_hook(lambda module, args, i=index: calls.append(i))
    tight_result = tight.forward_backward(samples, LossConfig())
    count = layers_to_checkpoint(4, 280, 256)  # ceil(4 · (1 - 256 / 336)) + 1 = 2 of the 4
    rebuilt = list(range(count))[::-1]  # backward rebuilds the checkpointed layers, last first
    assert calls == [0, 1, 2, 3, *rebuilt] * 2
    assert tight_result.loss == pytest.approx(planned_result.loss, rel=1e-6)
    for name, grad in tight.trainable_parameters().items():
        torch.testing.assert_close(grad.grad, grads[name], rtol=1e-5, atol=1e-7)
    calls.clear()  # a lone sample past the target is kept whole, as a padded row is
    tight.forward_backward(shaped_groups(groups=1, episodes=1, prompt=150, added=150), LossConfig())
    assert calls == [0, 1, 2, 3]
