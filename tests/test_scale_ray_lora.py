"""LoRA through ``RayModelService``: adapter-only sync into vLLM replicas, merged weights into
torch replicas, and training checkpoints that round-trip through the trainer actor."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from test_scale_common import FP32_BOUND, max_abs_diff, scale
from transformers import AutoModelForCausalLM

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.service.ray import RayModelService
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

pytestmark = scale
PROBE = list(range(3, 60))


def create(model: Path, **options: Any) -> RayModelService:
    settings: dict[str, Any] = {
        "num_generator_replicas": 1, "engine_dtype": "float32", "max_model_len": 1024,
    }  # fmt: skip
    trainer = TrainerSettings(use_lora=True, lora_rank=8, autocast_bf16=False, seed=0)
    info = resolve_model(str(model), codec="hermes")
    return asyncio.run(RayModelService.create(info, trainer, **(settings | options)))


def scored(tokens: list[int]) -> TrainingSample:
    ones = [0.0] + [1.0] * (len(tokens) - 1)
    return TrainingSample(tokens, ones, [0.0] * len(tokens), ones)


async def train_step(service: RayModelService, learning_rate: float = 0.05) -> int:
    """Push up the probe's likelihood: a step that visibly moves the adapter."""
    await service.forward_backward([scored(PROBE)], LossConfig())
    await service.optim_step(learning_rate)
    return await service.weights_sync()


def test_lora_adapter_sync_reaches_every_vllm_replica(scale_model: Path, ray_cluster: None) -> None:
    service = create(scale_model, generation_engine="vllm", num_generator_replicas=2)

    async def two_steps() -> list[tuple[float, list[float]]]:
        (before,) = await service.forward([scored(PROBE)])
        results = []
        for _ in range(2):
            await train_step(service)
            (trainer,) = await service.forward([scored(PROBE)])
            moved = max_abs_diff(trainer, before, scored(PROBE).mask)
            replicas = await service.score_on_generators(PROBE)
            results.append(
                (moved, [max_abs_diff(r, trainer, scored(PROBE).mask) for r in replicas])
            )
        return results

    try:
        results = asyncio.run(two_steps())
    finally:
        asyncio.run(service.close())
    print("adapter sync: (trainer moved, replica gaps) per step:", results)
    for moved, gaps in results:
        assert moved > 0.01  # the adapter changed the policy...
        assert max(gaps) < FP32_BOUND  # ...and each replica samples with exactly that adapter


def test_lora_merged_sync_reaches_torch_replicas_and_checkpoints_round_trip(
    scale_model: Path, ray_cluster: None, tmp_path: Path
) -> None:
    service = create(scale_model, generation_engine="torch", num_generator_replicas=2)
    params = SamplingParams(max_tokens=32, seed=3)

    async def train_sample_save() -> float:
        assert await train_step(service) == 1
        sequences = await asyncio.gather(*(service.sample(PROBE[:k], 2, params) for k in (9, 19)))
        gaps = []
        for prompt_length, pair in zip((9, 19), sequences, strict=True):
            for sequence in pair:
                tokens = PROBE[:prompt_length] + sequence.tokens
                mask = [0.0] * prompt_length + [1.0] * len(sequence.tokens)
                logprobs = [0.0] * prompt_length + sequence.logprobs
                sample = TrainingSample(tokens, mask, logprobs, mask)
                (trainer,) = await service.forward([sample])
                gaps.append(
                    max_abs_diff(sequence.logprobs, trainer[prompt_length:], mask[prompt_length:])
                )
        await service.save_training_checkpoint(tmp_path / "checkpoint")
        await service.save_inference_checkpoint(tmp_path / "final")
        return max(gaps)

    try:
        assert asyncio.run(train_sample_save()) < FP32_BOUND
        (trained,) = asyncio.run(service.forward([scored(PROBE)]))
    finally:
        asyncio.run(service.close())

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    with torch.no_grad():
        logits = merged(torch.tensor([PROBE])).logits[0]
    expected = [0.0] + [
        torch.log_softmax(logits[i - 1], -1)[PROBE[i]].item() for i in range(1, len(PROBE))
    ]
    assert max_abs_diff(expected, trained, scored(PROBE).mask) < FP32_BOUND

    resumed = create(scale_model, generation_engine="torch", num_generator_replicas=1)
    try:
        assert asyncio.run(resumed.load_training_checkpoint(tmp_path / "checkpoint")) == 1
        assert resumed.policy_state().applied_weights_version == 1
        (restored,) = asyncio.run(resumed.forward([scored(PROBE)]))
    finally:
        asyncio.run(resumed.close())
    assert max_abs_diff(restored, trained, scored(PROBE).mask) < 1e-6
