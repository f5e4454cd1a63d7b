"""A mixture-of-experts model through the local engine and the trainer (Qwen3.6-35B-A3B's kind).

A tiny random Qwen3-MoE (transformers' ``Qwen3MoeConfig``: 4 experts, 2 per token, one
sparse layer and one dense-MLP layer) samples through ``LocalModelService`` and trains, with
LoRA and full fine-tuning, and the engine's logprobs agree with the trainer's as they do for
dense models (``test_service``). The engine runs the model's own forward (the fused decode
step is for dense Llama-family models); with LoRA, peft adapts each expert's fused
``gate_up_proj``/``down_proj`` tensor (not the dense MLPs, see below) and the trainer merges
those adapters into the weights it hands the engine. The router is trained in full
fine-tuning and frozen under LoRA; the loss has no load-balancing term
(``output_router_logits`` stays off).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_service import make_service, mean_abs_gap, sample_episodes
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from post_training_cookbook.engine.fast_decode import FusedDecodeStep
from post_training_cookbook.service import WeightSyncType
from post_training_cookbook.trainer.types import LossConfig


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        mlp_only_layers=[1],  # layer 0 routes over experts, layer 1 is a dense MLP
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def test_the_fused_decode_step_does_not_claim_a_mixture_of_experts_model(moe_dir):
    model = Qwen3MoeForCausalLM.from_pretrained(moe_dir)
    assert FusedDecodeStep.for_model(model) is None


def test_lora_adapts_attention_and_each_experts_fused_tensors(moe_dir):
    """peft turns the ``gate_proj``/``up_proj``/``down_proj`` targets of a Qwen3-MoE into its
    experts' fused tensors; attention and the experts get an adapter. The dense MLP of
    ``mlp_only_layers`` gets one from peft 0.22 on (0.21 matched the names to the experts
    only and left it without)."""
    import peft
    from packaging.version import Version
    from peft.tuners.lora import LoraLayer

    service = make_service(moe_dir, use_lora=True)
    try:
        adapted = {
            (name.replace(".base_layer", ""), getattr(module, "parameter_name", None))
            for name, module in service.trainer._causal_lm.named_modules()
            if isinstance(module, LoraLayer)
        }
    finally:
        asyncio.run(service.close())
    experts = {("model.layers.0.mlp.experts", p) for p in ("gate_up_proj", "down_proj")}
    attention = {
        (f"model.layers.{layer}.self_attn.{proj}", None)
        for layer in (0, 1)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    dense = {(f"model.layers.1.mlp.{proj}", None) for proj in ("gate_proj", "up_proj", "down_proj")}
    dense_adapted = Version(peft.__version__) >= Version("0.22")
    assert adapted == experts | attention | (dense if dense_adapted else set())


def expert_tensors(service):
    """The expert, router and (with LoRA) expert-adapter tensors of the trainer's model."""
    named = dict(service.trainer._causal_lm.named_parameters())
    return {
        name: tensor.detach().clone()
        for name, tensor in named.items()
        if ".mlp.experts" in name or ".mlp.gate." in name
    }


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_a_mixture_of_experts_model_samples_and_trains_with_logprobs_agreeing(moe_dir, use_lora):
    async def scenario():
        service = make_service(moe_dir, use_lora=use_lora)
        try:
            samples, versions = await sample_episodes(service, seed=1)
            assert set(versions) == {0}
            before = mean_abs_gap(samples, await service.forward(samples))
            tensors_before = expert_tensors(service)
            for _ in range(2):
                await service.forward_backward(samples, LossConfig())
                assert not (await service.optim_step(5e-2)).skipped
            stale = mean_abs_gap(samples, await service.forward(samples))
            version = await service.weights_sync(WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS)
            fresh, versions = await sample_episodes(service, seed=2)
            after = mean_abs_gap(fresh, await service.forward(fresh))
            return before, stale, after, version, versions, tensors_before, expert_tensors(service)
        finally:
            await service.close()

    before, stale, after, version, versions, old, new = asyncio.run(scenario())
    assert before <= 1e-4 and after <= 1e-4
    assert stale > 100 * max(before, 1e-6)  # the update really moved the policy
    assert version == 2 and set(versions) == {2}
    moved = {name for name in old if not torch.equal(old[name], new[name])}
    if use_lora:
        adapters = {name for name in old if "lora_" in name}
        assert adapters and moved == adapters  # expert adapters train; experts, router frozen
    else:
        assert moved == set(old) and any(".mlp.gate." in n for n in moved)
