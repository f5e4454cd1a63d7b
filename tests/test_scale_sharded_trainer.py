"""The sharded trainer (``num_trainer_workers=2``: two Ray actors, FSDP2 over gloo on
loopback) behind ``RayModelService``: one step equals one process's, for full weight and
LoRA (and with gradient checkpointing and the KL reference; within bf16's rounding, for bf16
weights); the weights reach torch replicas by
broadcast (and through the object store); a sharded checkpoint resumes exactly at two
workers and in one process, and a damaged one is refused before anything changes; a killed
worker is named, not waited on. (``train_multi_turn`` with two workers:
``test_scale_sharded_loop.py``, on a Ray of its own.)

The one-process baseline is a plain ``Trainer`` built here from the same settings and seed.
Tolerances are fp32's: the sharded step sums the same terms in another order (each rank's
micro-batches, then a reduce-scatter). The loss and the gradient norm agree to 1e-6
relative. Updated weights agree to 1% of the learning rate, not to fp32 rounding: AdamW's
first step moves each weight by about ``lr·g/(|g| + eps)``, so a gradient element within
rounding of zero can land on another tiny value, or the other sign, under another order. The
gradient norm is what catches a gradient of the wrong scale (AdamW's step does not see it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_scale_common import FP32_BOUND, max_abs_diff, scale
from transformers import AutoModelForCausalLM

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.files import BadFileError
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.service import ray_startup
from post_training_cookbook.service.ray import RayModelService, WorkerDiedError
from post_training_cookbook.trainer.sharded import TrainerGroup, spawn_ranks
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    TrainerSettings,
    TrainingSample,
)

pytestmark = scale
LR = 1e-3
LOSS = LossConfig()
WEIGHT_TOL = 0.01 * LR
"""Updated weights, sharded vs one process (see the module docstring)."""


def batch() -> list[TrainingSample]:
    """Eight episodes of different lengths (so the two ranks get unequal micro-batches),
    half with positive and half with negative advantages."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for i, length in enumerate((41, 12, 33, 7, 26, 18, 9, 30)):
        tokens = torch.randint(3, 200, (length,), generator=generator).tolist()
        mask = [0.0] + [1.0] * (length - 1)
        advantage = 1.0 if i % 2 else -1.0
        samples.append(
            TrainingSample(
                tokens, mask, [0.0] + [-5.0] * (length - 1), [a * advantage for a in mask]
            )
        )
    return samples


def settings(use_lora: bool) -> TrainerSettings:
    """fp32 without autocast, and micro-batches small enough that each rank runs several."""
    return TrainerSettings(
        use_lora=use_lora, lora_rank=8, autocast_bf16=False, seed=0, micro_batch_tokens=64
    )


def create(model: Path, use_lora: bool, **options: Any) -> RayModelService:
    info = resolve_model(str(model), codec="hermes")
    defaults: dict[str, Any] = {
        "num_trainer_workers": 2, "num_generator_replicas": 1, "generation_engine": "torch",
        "engine_dtype": "float32", "max_model_len": 1024, "collective_timeout_s": 120.0,
    }  # fmt: skip
    return asyncio.run(RayModelService.create(info, settings(use_lora), **(defaults | options)))


def step(service: RayModelService) -> tuple[ForwardBackwardResult, OptimStepResult]:
    async def both() -> tuple[ForwardBackwardResult, OptimStepResult]:
        return await service.forward_backward(batch(), LOSS), await service.optim_step(LR)

    return asyncio.run(both())


def assert_same_step(
    got: tuple[ForwardBackwardResult, OptimStepResult],
    expected: tuple[ForwardBackwardResult, OptimStepResult],
) -> None:
    (loss, optim), (expected_loss, expected_optim) = got, expected
    assert loss.loss == pytest.approx(expected_loss.loss, rel=1e-6, abs=1e-9)
    assert loss.num_tokens == expected_loss.num_tokens
    assert loss.metrics == pytest.approx(expected_loss.metrics, rel=1e-5, abs=1e-7)
    # 1e-5 as the metrics: packed micro-batches (64-token streams) group the samples of one
    # process otherwise than each rank's share, so fp32 gradients add up in another order
    assert optim.grad_norm == pytest.approx(expected_optim.grad_norm, rel=1e-5)
    assert optim.version == expected_optim.version and not optim.skipped


def saved_weights(service: RayModelService, folder: Path) -> dict[str, torch.Tensor]:
    """The service's inference checkpoint, which ``transformers`` loads, as a state dict."""
    asyncio.run(service.save_inference_checkpoint(folder))
    AutoModelForCausalLM.from_pretrained(folder)  # loads
    return load_file(folder / "model.safetensors")


def max_weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def full_weight(scale_model: Path, ray_cluster: None) -> Iterator[RayModelService]:
    """Two trainer ranks, two torch replicas, weights by broadcast (``auto``)."""
    service = create(scale_model, False, num_generator_replicas=2)
    yield service
    asyncio.run(service.close())


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-weight", "lora"])
def test_two_workers_take_the_step_of_one_same_loss_gradient_norm_and_weights(
    use_lora: bool, full_weight: RayModelService, scale_model: Path, tmp_path: Path
) -> None:
    """Full weight on the module's service (broadcast); LoRA on its own, which publishes
    through the object store."""
    service = full_weight
    if use_lora:
        service = create(scale_model, True, weight_transport="object_store")
    try:
        baseline = Trainer(str(scale_model), settings(use_lora))
        before = baseline.state_dict_for_inference()
        start = saved_weights(service, tmp_path / "start")
        assert max_weight_gap(start, before) == 0.0  # the same start on every rank
        expected = baseline.forward_backward(batch(), LOSS), baseline.optim_step(LR)
        got = step(service)
        assert_same_step(got, expected)
        updated = saved_weights(service, tmp_path / "updated")
        moved = max_weight_gap(updated, before)
        gap = max_weight_gap(updated, baseline.state_dict_for_inference())
        print(f"use_lora={use_lora}: weights moved {moved:.2e}, sharded vs one process {gap:.2e}")
        assert moved > 0.5 * LR and gap < WEIGHT_TOL
        (trainer_logprobs,) = asyncio.run(service.forward(batch()[:1]))
        (expected_logprobs,) = baseline.forward(batch()[:1])
        assert max_abs_diff(trainer_logprobs, expected_logprobs, batch()[0].mask) < 1e-4
        gaps = asyncio.run(sync_and_sample(service))
        print(f"{service.weight_transport}: |replica - trainer| logprob per sample {gaps}")
        assert max(gaps) < FP32_BOUND
    finally:
        if use_lora:
            asyncio.run(service.close())


async def sync_and_sample(service: RayModelService) -> list[float]:
    """Publish, then sample on every replica at once (the router spreads prompts without a
    known prefix by load) and compare each sequence's logprobs with the trainer's."""
    version = await service.weights_sync()
    assert service.policy_state().applied_weights_version == version
    replicas = len(service.workers) - service.num_trainer_workers
    prompts = [list(range(5 + i, 20 + i)) for i in range(replicas)]
    params = SamplingParams(max_tokens=24, seed=1)
    sampled = await asyncio.gather(*(service.sample(p, 2, params) for p in prompts))
    gaps = []
    for prompt, sequences in zip(prompts, sampled, strict=True):
        for sequence in sequences:
            tokens = prompt + sequence.tokens
            mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
            logprobs = [0.0] * len(prompt) + sequence.logprobs
            (trainer,) = await service.forward([TrainingSample(tokens, mask, logprobs, mask)])
            gaps.append(max_abs_diff(logprobs, trainer, mask))
    stats = await service.generator_stats()
    assert all(s["engine/sequences_finished"] > 0 for s in stats)  # every replica sampled
    assert all(s["engine/weight_updates"] >= 1 for s in stats)  # and got the weights
    return gaps


@pytest.fixture(scope="module")
def second(scale_model: Path, ray_cluster: None) -> Iterator[RayModelService]:
    """Another two-rank service: it resumes the first one's checkpoint, then loses a rank."""
    service = create(scale_model, False)
    yield service
    asyncio.run(service.close())


def test_a_sharded_checkpoint_resumes_exactly_at_two_workers_and_in_one_process(
    full_weight: RayModelService, second: RayModelService, scale_model: Path, tmp_path: Path
) -> None:
    """The next step after resuming equals the uninterrupted run's next step; a damaged copy
    (a rank's shard file cut short, or DCP's metadata overwritten) is refused, naming the
    file, and leaves the trainer as it was."""
    checkpoint = tmp_path / "checkpoint"
    step(full_weight)  # optimizer state to save
    asyncio.run(full_weight.save_training_checkpoint(checkpoint))
    assert {p.name for p in checkpoint.iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    uninterrupted = step(full_weight)

    probe = batch()[:2]
    before = asyncio.run(second.forward(probe))
    for damaged_file, damage in (("__1_0.distcp", "cut"), (".metadata", "overwritten")):
        damaged = tmp_path / f"damaged-{damage}"
        shutil.copytree(checkpoint, damaged)
        path = damaged / damaged_file
        if damage == "cut":
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.write_bytes(b"\0" * path.stat().st_size)
        with pytest.raises(BadFileError, match=damaged_file):
            asyncio.run(second.load_training_checkpoint(damaged))
        assert asyncio.run(second.forward(probe)) == before  # nothing changed

    version = asyncio.run(second.load_training_checkpoint(checkpoint))
    assert version == uninterrupted[1].version - 1
    assert_same_step(step(second), uninterrupted)

    one = Trainer(str(scale_model), settings(False))
    one.load_training_checkpoint(checkpoint)  # DCP reshards two ranks' shards into one
    assert one.version == version
    assert_same_step((one.forward_backward(batch(), LOSS), one.optim_step(LR)), uninterrupted)


def test_a_killed_worker_is_named_within_seconds_not_waited_on(second: RayModelService) -> None:
    """Runs last on its service: SIGKILL of rank 1 while the ranks train back to back. The
    collective timeout is 120 s; Ray reports the death long before it."""
    pid = second.workers[1]["pid"]

    async def train_until_it_fails() -> None:
        while True:
            await second.forward_backward(batch() * 4, LOSS)

    async def kill_mid_step() -> float:
        training = asyncio.ensure_future(train_until_it_fails())
        await asyncio.sleep(2.0)
        os.kill(pid, signal.SIGKILL)
        killed = time.perf_counter()
        with pytest.raises(WorkerDiedError, match=rf"trainer rank 1 \(pid {pid} on .*\) died"):
            await asyncio.wait_for(training, 60)
        return time.perf_counter() - killed

    reported_after = asyncio.run(kill_mid_step())
    print(f"the dead rank was reported {reported_after:.1f}s after SIGKILL")
    assert reported_after < 30


# ---------------------------------------------------------------- in two processes, no Ray

VARIANTS: dict[str, tuple[dict[str, Any], LossConfig]] = {
    "bf16": ({"precision": "bf16"}, LOSS),
    "checkpointed-kl": (
        {"gradient_checkpointing": True, "reference_model": True},
        LossConfig(kl_beta=0.1),
    ),
}
"""Trainer options checked in two spawned processes (cheaper than Ray actors): bf16 weights
with fp32 masters; gradient checkpointing with the KL term's frozen reference, sharded too."""


def variant_rank(rank: int, address: str, model: str, variant: str, out: str) -> None:
    """One rank of a two-process trainer: one step, then its merged weights (rank 0)."""
    torch.set_num_threads(1)
    loss_config = VARIANTS[variant][1]
    group = TrainerGroup(rank, 2, address, timeout_s=120)
    trainer = Trainer(model, variant_settings(variant), group=group)
    loss, optim = trainer.forward_backward(batch(), loss_config), trainer.optim_step(LR)
    weights = trainer.state_dict_for_inference()
    if rank == 0:
        torch.save({"step": (loss, optim), "weights": weights}, out)
    trainer.close()


def variant_settings(variant: str) -> TrainerSettings:
    return dataclasses.replace(settings(False), **VARIANTS[variant][0])


def two_process_step(model: Path, variant: str, folder: Path) -> dict[str, Any]:
    out = folder / "rank0.pt"
    spawn_ranks(variant_rank, (str(model), variant, str(out)), nprocs=2)
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


def test_gradient_checkpointing_and_the_kl_reference_shard_with_the_same_step(
    scale_model: Path, tmp_path: Path
) -> None:
    sharded = two_process_step(scale_model, "checkpointed-kl", tmp_path)
    one = Trainer(str(scale_model), variant_settings("checkpointed-kl"))
    before = one.state_dict_for_inference()
    expected = one.forward_backward(batch(), VARIANTS["checkpointed-kl"][1]), one.optim_step(LR)
    assert expected[0].metrics["loss/kl_ref"] == 0.0  # the first step: the policy is the reference
    assert_same_step(sharded["step"], expected)
    after = one.state_dict_for_inference()
    assert max_weight_gap(after, before) > 0.5 * LR
    assert max_weight_gap(sharded["weights"], after) < WEIGHT_TOL


def test_bf16_weights_with_fp32_masters_shard_too_within_bf16_rounding(
    scale_model: Path, tmp_path: Path
) -> None:
    """``MasterWeightAdamW`` steps each rank's shards (masters and moments are sharded like
    their weights). bf16 gradients summed in another order differ in their last bits, so
    the bound is on the update as a whole: measured, 0.05-0.1% of the weights differ (a tiny
    gradient's sign, one rounding step) and the updates' cosine is 0.9997-0.9998."""
    sharded = two_process_step(scale_model, "bf16", tmp_path)
    one = Trainer(str(scale_model), variant_settings("bf16"))
    start = {name: t.float() for name, t in one.state_dict_for_inference().items()}
    loss, optim = one.forward_backward(batch(), LOSS), one.optim_step(LR)
    got_loss, got_optim = sharded["step"]
    assert got_loss.loss == pytest.approx(loss.loss, rel=1e-6)
    assert got_optim.grad_norm == pytest.approx(optim.grad_norm, rel=1e-4)
    weights = one.state_dict_for_inference()
    expected = torch.cat([(weights[n].float() - start[n]).flatten() for n in start])
    got = torch.cat([(sharded["weights"][n].float() - start[n]).flatten() for n in start])
    differ = (got != expected).float().mean().item()
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
    print(f"bf16: {differ:.2%} of the weights differ; cosine of the updates {cosine:.5f}")
    assert expected.abs().mean() > 0.5 * LR  # the step moved the weights
    assert differ < 0.01 and cosine > 0.999


def test_a_trainer_ray_cannot_place_is_reported_while_it_waits_then_refused(
    scale_model: Path, ray_cluster: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Two ranks of 100 CPUs each on an 8-CPU Ray: a warning while it waits, then the
    startup timeout's error naming what Ray had free, with nothing left reserved."""
    import ray

    monkeypatch.setattr(ray_startup, "PLACEMENT_NOTICE_S", 1.0)
    free_before = ray.available_resources().get("CPU")
    refused = pytest.raises(RuntimeError, match=r"not placed within 3\.5s.*free resources")
    with caplog.at_level(logging.WARNING, logger=ray_startup.__name__), refused:
        create(scale_model, False, num_cpus_per_actor=100.0, startup_timeout_s=3.5)
    assert "has not placed 2 trainer ranks ({'CPU': 100.0} each) after 1s" in caplog.text
    assert "after 3s" in caplog.text
    deadline = time.monotonic() + 30  # Ray's resource view follows the removal shortly
    while ray.available_resources().get("CPU") != free_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == free_before  # the group was removed
