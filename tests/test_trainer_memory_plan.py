"""The memory plan: micro-batch size and gradient checkpointing chosen from the model's
shape and the free memory, where the settings leave them None (``trainer/memory_plan.py``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from test_trainer_packing import shaped_groups, tiny_model

from post_training_cookbook.trainer import memory_plan
from post_training_cookbook.trainer.memory_plan import (
    MicroBatchShape,
    layers_to_checkpoint,
    plan_memory,
    step_footprint,
    trained_parameter_count,
)
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings

CPU = torch.device("cpu")


def with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(memory_plan, "free_bytes", lambda device: free)


def footprint(
    model: transformers.PreTrainedModel, device: torch.device = CPU, activation_bytes: int = 4
) -> memory_plan.StepFootprint:
    return step_footprint(model, device, activation_bytes=activation_bytes, lora_rank=0,
                          trained_parameters=trained_parameter_count(model, 0, ()),
                          layer_trained_parameters=trained_parameter_count(
                              model, 0, (), in_layers=True),
                          chunk_tokens=None)  # fmt: skip


def test_checkpointing_keeps_less_than_every_layer_does() -> None:
    model = tiny_model("llama")
    full = footprint(model).token_bytes(checkpointing=False)
    assert footprint(model).token_bytes(checkpointing=True) < full
    assert footprint(model, activation_bytes=2).token_bytes(checkpointing=False) < full


def test_a_full_weight_kl_reference_counts_against_the_budget() -> None:
    """The reference is copied from the weights after the free memory was read."""
    model = tiny_model("llama")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with_reference = step_footprint(model, CPU, activation_bytes=4, lora_rank=0,
                                    trained_parameters=trained_parameter_count(model, 0, ()),
                                    chunk_tokens=None, reference_copy=True)  # fmt: skip
    assert with_reference.state_bytes - footprint(model).state_bytes == weights


def test_the_layers_gradients_are_the_decoder_layers_trained_weights_or_adapters() -> None:
    model = tiny_model("llama")
    layers = sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    assert footprint(model).layer_gradient_bytes == 4 * layers  # not the tied embedding's
    targets = ("q_proj", "lm_head")  # an adapter on the head is not a layer's
    q = model.model.layers[0].self_attn.q_proj
    assert trained_parameter_count(model, 8, targets, in_layers=True) == 2 * 8 * (
        q.in_features + q.out_features
    )


def test_a_lone_micro_batch_peaks_before_the_layers_gradients_exist() -> None:
    """One micro-batch kept whole: its tensors, or the layers' gradients backward makes as
    it frees them, whichever is larger; beside a second micro-batch, or with a checkpointed
    layer (rebuilt after the layers above made theirs), the whole state."""
    model = tiny_model("llama")
    model_footprint = footprint(model)
    late = model_footprint.layer_gradient_bytes
    runtime = memory_plan.RUNTIME_BYTES
    state = model_footprint.state_bytes
    slack = memory_plan.HEAP_SLACK_ONE_MICRO_BATCH
    large = MicroBatchShape(tokens=4096, trained=2048, keys=256)
    tensors = int(slack * model_footprint.micro_batch_bytes(large))
    assert tensors > late
    assert model_footprint.step_bytes([large]) == state - late + runtime + tensors
    small = MicroBatchShape(tokens=1, trained=1, keys=1)
    assert int(slack * model_footprint.micro_batch_bytes(small)) < late
    assert model_footprint.step_bytes([small]) == state + runtime
    two = model_footprint.step_bytes([large, small])
    assert two == state + runtime + int(
        memory_plan.HEAP_SLACK * model_footprint.micro_batch_bytes(large)
    )
    checkpointed = replace(large, checkpointed_layers=1)
    assert model_footprint.step_bytes([checkpointed]) == state + runtime + int(
        slack * model_footprint.micro_batch_bytes(checkpointed)
    )


def test_a_chunk_s_logits_mapped_on_their_own_take_no_heap_slack() -> None:
    """At SmolLM2's vocabulary a 256-position chunk's logits take 48 MiB, which glibc maps
    on their own; a 64-position chunk's 12 MiB sit in the heap, with its slack."""
    smollm2_head = replace(footprint(tiny_model("llama")), logit_row_bytes=4 * 49152)
    for positions, mapped in ((256, True), (64, False)):
        batch = MicroBatchShape(tokens=1024, trained=positions, keys=256, chunk_tokens=256)
        chunk = positions * 4 * smollm2_head.logit_row_bytes  # four tensors
        rest = smollm2_head.micro_batch_bytes(batch) - chunk
        held = int(memory_plan.HEAP_SLACK * (rest if mapped else rest + chunk))
        assert smollm2_head.held_bytes(batch, 2) == held + (chunk if mapped else 0)


def test_a_lora_trainer_s_frozen_head_keeps_three_vocabulary_tensors_of_a_chunk() -> None:
    def vocab_tensors(use_lora: bool) -> int:
        trainer = Trainer(
            tiny_model("llama"),
            TrainerSettings(
                use_lora=use_lora,
                micro_batch_tokens=256,
                gradient_checkpointing=False,
                autocast_bf16=False,
            ),
        )
        return trainer.footprint.vocab_tensors

    assert (vocab_tensors(True), vocab_tensors(False)) == (3, 4)


def plan(model: transformers.PreTrainedModel, device: torch.device = CPU) -> memory_plan.MemoryPlan:
    return plan_memory(footprint(model, device), device, memory_budget=0.5,
                       micro_batch_tokens=None, gradient_checkpointing=None)  # fmt: skip


def test_plenty_of_memory_takes_the_device_s_micro_batch_without_checkpointing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_free(monkeypatch, 2**40)
    on_cpu, on_gpu = plan(tiny_model("llama")), plan(tiny_model("llama"), torch.device("cuda"))
    # A CPU is no faster a token past 2k tokens; a stream sharing a prefix may grow to 8k.
    assert (on_cpu.micro_batch_tokens, on_cpu.shared_stream_tokens) == (2048, 8192)
    assert (on_gpu.micro_batch_tokens, on_gpu.shared_stream_tokens) == (8192, 8192)
    assert not on_cpu.gradient_checkpointing and not on_gpu.gradient_checkpointing


def free_fitting(model_footprint: memory_plan.StepFootprint, tokens: int) -> int:
    """The least free memory whose half fits a step of ``tokens``-token micro-batches
    without checkpointing."""
    low, high = 0, 2**40
    while low < high:
        middle = (low + high) // 2
        if model_footprint.tokens_fitting(middle // 2, checkpointing=False) >= tokens:
            high = middle
        else:
            low = middle + 1
    return low


def test_little_memory_turns_checkpointing_on_then_shrinks_the_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    cuda = torch.device("cuda")
    with_free(monkeypatch, free_fitting(footprint(model), 4096))  # 4096 tokens fit, no ckpt
    on_cpu = plan(model)
    assert not on_cpu.gradient_checkpointing  # the CPU's 2048 fit
    assert (on_cpu.micro_batch_tokens, on_cpu.shared_stream_tokens) == (2048, 4096)
    free = free_fitting(footprint(model, cuda), 4096)
    with_free(monkeypatch, free)
    on_gpu = plan(model, cuda)
    assert on_gpu.gradient_checkpointing  # the GPU's 8192 do not
    expected = footprint(model, cuda).tokens_fitting(free // 2, checkpointing=True)
    assert on_gpu.micro_batch_tokens == on_gpu.shared_stream_tokens == min(8192, expected)
    with_free(monkeypatch, 1000)
    tight = plan(model)
    assert (tight.micro_batch_tokens, tight.gradient_checkpointing) == (256, True)  # the floor
    assert tight.shared_stream_tokens == 256


def test_explicit_fields_win_and_the_plan_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_free(monkeypatch, 1000)
    with caplog.at_level(logging.INFO, logger="post_training_cookbook.trainer.memory_plan"):
        trainer = Trainer(
            tiny_model("qwen2"),
            TrainerSettings(
                use_lora=True,
                micro_batch_tokens=300,
                gradient_checkpointing=None,
                autocast_bf16=False,
            ),
        )
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (300, True)
    assert trainer.shared_stream_tokens == 300  # a given micro-batch bounds streams too
    messages = [  # (the log-probability chunk is said apart)
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("memory_plan") and "micro_batch_tokens" in r.getMessage()
    ]
    assert len(messages) == 1 and "micro_batch_tokens=300 (as set)" in messages[0]
    trainer = Trainer(
        tiny_model("qwen2"),
        TrainerSettings(
            use_lora=True,
            micro_batch_tokens=None,
            gradient_checkpointing=False,
            autocast_bf16=False,
        ),
    )
    assert (trainer.micro_batch_tokens, trainer.gradient_checkpointing) == (256, False)


def test_a_memory_budget_outside_0_1_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        Trainer("/nonexistent", TrainerSettings(use_lora=True, memory_budget=1.5))


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


def layer_calls(trainer: Trainer) -> list[int]:
    """The indices of the decoder layers ``trainer`` runs, in order, backward's rebuilds
    included."""
    calls: list[int] = []
    for index, layer in enumerate(trainer._stream_checkpointing.layers):  # type: ignore[union-attr]
        layer.register_forward_pre_hook(lambda module, args, i=index: calls.append(i))
    return calls


def test_a_stream_larger_than_its_padded_rows_checkpoints_some_layers_with_the_same_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's stream that holds more tokens than the padded rows of its samples would at
    once runs its first layers checkpointed, each forwarded again in backward, within the
    micro-batch's tokens too; the update is the plain path's."""
    with_free(monkeypatch, 2**40)
    monkeypatch.setattr(memory_plan, "CPU_MICRO_BATCH_TOKENS", 300)
    samples = shaped_groups(groups=2, episodes=4, prompt=120, added=40)  # streams of 280
    planned = Trainer(
        four_layers(),
        TrainerSettings(
            use_lora=True,
            micro_batch_tokens=None,
            gradient_checkpointing=None,
            autocast_bf16=False,
            seed=0,
        ),
    )
    assert (planned.micro_batch_tokens, planned.gradient_checkpointing) == (300, False)
    calls = layer_calls(planned)
    chunks: list[int | None] = []  # the log-probability chunk while the decoder runs
    first_layer = planned._stream_checkpointing.layers[0]  # type: ignore[union-attr]
    first_layer.register_forward_pre_hook(lambda *_: chunks.append(planned._scorer.chunk_tokens))
    planned_result = planned.forward_backward(samples, LossConfig())
    # Within the 300-token target, each group is a stream of 280 tokens, while the padded
    # layout holds one 160-token row at a time: checkpointed as a stream past 160 would be.
    count = layers_to_checkpoint(4, 280, 160)  # ceil(4 · (1 - 160 / 336)) + 1 = 4 of the 4
    assert count == 4
    rebuilt = list(range(count))[::-1]  # backward rebuilds the checkpointed layers, last first
    assert calls == [0, 1, 2, 3, *rebuilt] * 2
    # ... and its log-probabilities chunked by that row's 159 trained positions (not 1,024).
    assert planned.logprob_chunk_tokens == 1024 and set(chunks) == {159}
    assert planned._scorer.chunk_tokens == 1024
    plain = Trainer(
        four_layers(),
        TrainerSettings(
            use_lora=True,
            micro_batch_tokens=300,
            gradient_checkpointing=False,
            autocast_bf16=False,
            seed=0,
        ),
    )
    plain_result = plain.forward_backward(samples, LossConfig())
    assert plain_result.loss == pytest.approx(planned_result.loss, rel=1e-6)
    for name, parameter in planned.trainable_parameters().items():
        expected = plain.trainable_parameters()[name].grad
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-5, atol=1e-7)
    calls.clear()  # a lone sample is kept whole, as a padded row is
    planned.forward_backward(
        shaped_groups(groups=1, episodes=1, prompt=150, added=150), LossConfig()
    )
    assert calls == [0, 1, 2, 3]


def test_a_stream_the_padded_rows_would_hold_as_well_checkpoints_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_free(monkeypatch, 2**40)
    monkeypatch.setattr(memory_plan, "CPU_MICRO_BATCH_TOKENS", 300)
    # Samples of 60 tokens: five padded rows (300 tokens) a micro-batch; both groups' streams
    # (2 × 120 tokens) in one micro-batch hold fewer.
    samples = shaped_groups(groups=2, episodes=4, prompt=40, added=20)
    planned = Trainer(
        four_layers(),
        TrainerSettings(
            use_lora=True,
            micro_batch_tokens=None,
            gradient_checkpointing=None,
            autocast_bf16=False,
            seed=0,
        ),
    )
    calls = layer_calls(planned)
    planned.forward_backward(samples, LossConfig())
    assert calls == [0, 1, 2, 3]


def test_a_stream_past_the_micro_batch_checkpoints_against_the_padded_row_it_would_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group kept whole past ``micro_batch_tokens`` (the plan's bound) whose samples are
    longer than it: the padded layout would hold one such row, its target."""
    with_free(monkeypatch, 2**40)
    monkeypatch.setattr(memory_plan, "CPU_MICRO_BATCH_TOKENS", 256)
    samples = shaped_groups(groups=1, episodes=4, prompt=240, added=40)  # samples of 280
    tight = Trainer(
        four_layers(),
        TrainerSettings(
            use_lora=True,
            micro_batch_tokens=None,
            gradient_checkpointing=None,
            autocast_bf16=False,
            seed=0,
        ),
    )
    assert tight.micro_batch_tokens == 256 and tight.shared_stream_tokens >= 400
    calls = layer_calls(tight)
    tight.forward_backward(samples, LossConfig())
    count = layers_to_checkpoint(4, 400, 280)  # ceil(4 · (1 - 280 / 480)) + 1 = 3
    assert count == 3
    assert calls == [0, 1, 2, 3, *list(range(count))[::-1]]


BUDGETED_STEPS = """
import json, random, sys
from pathlib import Path

from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.trainer import memory_plan
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

free, share = int(sys.argv[1]), float(sys.argv[2])
memory_plan.free_bytes = lambda device: free  # the machine's free memory moves; this does not
settings = TrainerSettings(use_lora=False, seed=0, device="cpu", micro_batch_tokens=None,
                           gradient_checkpointing=None, memory_budget=share)
trainer = Trainer(resolve_model(BUNDLED_MODEL_ID).source, settings)
rng = random.Random(0)
prompt = [rng.randrange(1536) for _ in range(768)]
samples = []
for _ in range(8):  # a group of 8 completions of 256 tokens after a 768-token prompt
    tokens = prompt + [rng.randrange(1536) for _ in range(256)]
    mask = [0.0] * 768 + [1.0] * 256
    advantage = rng.choice([-1.0, 1.0])
    samples.append(
        TrainingSample(tokens, mask, [-9.0 * m for m in mask], [advantage * m for m in mask])
    )

def status(field):
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(field)).split()[1]) * 1024

shapes = trainer.micro_batch_shapes(samples)
resident = status("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
for _ in range(2):  # AdamW's moments appear in the first step
    trainer.forward_backward(samples, LossConfig())
    trainer.optim_step(1e-6)
print(json.dumps({
    "peak": status("VmHWM:") - resident, "budget": int(free * share),
    "estimate": trainer.footprint.step_bytes(shapes), "micro_batches": len(shapes),
    "largest": max(s.tokens for s in shapes), "checkpointing": trainer.gradient_checkpointing,
}))
"""


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS"
)
def test_a_memory_budget_that_forces_splitting_is_never_exceeded() -> None:
    """The bundled model's group (a 2,816-token shared-prefix stream, 8,192 tokens padded),
    full weight, given 256 MiB (a quarter of 1 GiB free): the plan checkpoints and splits
    the group, and the step's peak resident set above the built trainer, measured in a
    fresh process (its heap as a real run's), stays within the budget."""
    child = subprocess.run(
        [sys.executable, "-c", BUDGETED_STEPS, str(2**30), "0.25"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    run = json.loads(child.stdout.strip().splitlines()[-1])
    assert run["checkpointing"] and run["micro_batches"] > 1 and run["largest"] < 2816
    assert run["estimate"] <= run["budget"]
    assert run["peak"] <= run["budget"], run
