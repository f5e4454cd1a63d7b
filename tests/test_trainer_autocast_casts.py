"""Under bf16 autocast the norms' outputs are cast once, not once per projection
(``precision.cast_norm_outputs_once``): the same forward, gradients within bf16's rounding,
fewer copies kept for backward."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from test_trainer_packing import tiny_model

from post_training_cookbook.trainer.precision import cast_norm_outputs_once
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import (
    DEFAULT_LORA_TARGETS,
    LossConfig,
    TrainerSettings,
    TrainingSample,
)


def with_lora(model: transformers.PreTrainedModel) -> torch.nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(DEFAULT_LORA_TARGETS))
    torch.manual_seed(1)  # the same adapter on every copy
    lora = get_peft_model(model, config, autocast_adapter_dtype=False)
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapter a say in the output
            torch.nn.init.normal_(parameter, std=0.1)
    return lora


def step(
    model: torch.nn.Module, tokens: torch.Tensor, autocast: bool = True
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """Loss (under bf16 autocast), the bytes autograd kept for backward, and the gradients."""
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    kept_for_backward = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with kept_for_backward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sum(kept.values()), grads


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    difference = sum(float((a[n] - b[n]).norm() ** 2) for n in b) ** 0.5
    return difference / sum(float(b[n].norm() ** 2) for n in b) ** 0.5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("use_lora", [True, False])
def test_casting_once_keeps_the_forward_and_the_gradients_within_bf16_rounding(
    family: str, use_lora: bool
) -> None:
    model = tiny_model(family)
    copies = (model, copy.deepcopy(model), copy.deepcopy(model))
    plain, once, exact = (with_lora(m) if use_lora else m for m in copies)
    assert cast_norm_outputs_once(once.get_base_model() if use_lora else once)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=generator)
    plain_loss, plain_bytes, plain_grads = step(plain, tokens)
    once_loss, once_bytes, once_grads = step(once, tokens)
    _, _, fp32_grads = step(exact, tokens, autocast=False)
    assert torch.equal(plain_loss, once_loss)  # the one cast rounds as each did
    assert plain_grads.keys() == once_grads.keys() == fp32_grads.keys() and plain_grads
    # The gradient reaching a norm's output is summed in bf16, not fp32: as far from the
    # fp32 gradients as autocast's own rounding puts them, give or take.
    plain_error = relative_error(plain_grads, fp32_grads)
    assert relative_error(once_grads, fp32_grads) < 2 * plain_error + 1e-3
    assert relative_error(once_grads, plain_grads) < 2 * plain_error + 1e-3
    assert once_bytes < 0.95 * plain_bytes


def test_outside_autocast_and_for_other_families_nothing_changes() -> None:
    model = tiny_model("llama")
    hooked = copy.deepcopy(model)
    cast_norm_outputs_once(hooked)
    tokens = torch.arange(20)[None]
    with torch.no_grad():  # no autocast: fp32 throughout, as before
        assert hooked.model.layers[0].input_layernorm(torch.ones(1, 3, 32)).dtype == torch.float32
        assert torch.equal(model(tokens).logits, hooked(tokens).logits)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2))
    assert not cast_norm_outputs_once(gpt2)


def test_a_trainer_under_autocast_casts_once() -> None:
    trainer = Trainer(
        tiny_model("llama"), TrainerSettings(use_lora=True, autocast_bf16=True, seed=0)
    )
    norm = trainer._causal_lm.model.layers[0].input_layernorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.ones(1, 3, 32)).dtype == torch.bfloat16
    sample = TrainingSample(list(range(1, 12)), [0.0] * 5 + [1.0] * 6, [-1.0] * 11, [1.0] * 11)
    assert torch.isfinite(torch.tensor(trainer.forward_backward([sample], LossConfig()).loss))
