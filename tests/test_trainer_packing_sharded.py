"""Packed micro-batches on a sharded trainer: how they are split across ranks, and (in the
scale step) two FSDP2 ranks over loopback gloo, started here without Ray, taking the step of
one plain process, full weight and LoRA with gradient checkpointing, with the KL reference
(``packing.split_packed_across_ranks``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_packing import group_samples, moved_weights, tiny_model

from post_training_cookbook.trainer.packing import (
    split_packed_across_ranks,
    stream_tokens,
)
from post_training_cookbook.trainer.sharded import TrainerGroup, spawn_ranks
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

LOSS = LossConfig(kl_beta=0.05)


@pytest.mark.parametrize("mode", ["packed", "shared_prefix"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("budget", [20, 4096])
def test_every_rank_gets_as_many_packed_micro_batches_and_every_sample_lands_once(
    mode: str, world_size: int, budget: int
) -> None:
    samples = group_samples()
    plans = split_packed_across_ranks(samples, world_size, budget, mode)  # type: ignore[arg-type]
    assert len({len(plan) for plan in plans}) == 1
    landed = sorted(i for plan in plans for unit in plan for i in unit)
    assert landed == list(range(len(samples)))
    loads = [
        sum(stream_tokens([samples[i] for i in unit], budget, mode) for unit in plan)  # type: ignore[arg-type]
        for plan in plans
    ]
    longest = max(len(s.tokens) for s in samples)
    assert max(loads) - min(loads) <= max(longest, -(-sum(loads) // world_size))


def test_ranks_still_share_prefixes_and_each_cut_costs_at_most_one_prefix_again() -> None:
    samples = group_samples()
    plans = split_packed_across_ranks(samples, 2, 4096, "shared_prefix")
    units = [unit for plan in plans for unit in plan if unit]
    shared = sum(stream_tokens([samples[i] for i in u], 4096, "shared_prefix") for u in units)
    one_process = stream_tokens(samples, 4096, "shared_prefix")
    longest = max(len(s.tokens) for s in samples)
    assert one_process <= shared <= one_process + (len(units) - 1) * longest
    assert shared < stream_tokens(samples, 4096, "packed")  # prompts are still shared


def _rank(rank: int, address: str, mode: str, lora: bool, out: str) -> None:
    torch.set_num_threads(1)
    trainer = _trainer(mode, TrainerGroup(rank, 2, address, timeout_s=120.0), lora)
    torch.save((rank, *_step(trainer)), f"{out}/rank{rank}.pt")
    trainer.close()


def _trainer(mode: str, group: TrainerGroup | None, lora: bool = False) -> Trainer:
    """Full weight, or LoRA with gradient checkpointing; the KL reference either way."""
    model = tiny_model("qwen2")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(moved_weights(tiny_model("qwen2"))[name])
    return Trainer(
        model,
        TrainerSettings(
            use_lora=lora,
            gradient_checkpointing=lora,
            autocast_bf16=False,
            reference_model=True,
            seed=1,
            micro_batch_tokens=40,
            packing=mode != "off",
            shared_prefix=mode == "shared_prefix",
        ),
        group=group,
    )


def _step(trainer: Trainer) -> tuple[float, float, list[list[float]]]:
    samples: list[TrainingSample] = group_samples()
    loss = trainer.forward_backward(samples, LOSS).loss
    logprobs = trainer.forward(samples)
    grad_norm = trainer.optim_step(1e-3).grad_norm
    return loss, grad_norm, logprobs


@pytest.mark.scale  # the sharded trainer's step (scripts/test_scale.sh), without Ray
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-checkpointed"])
@pytest.mark.parametrize("mode", ["packed", "shared_prefix"])
def test_two_sharded_ranks_with_packing_take_the_step_of_one_plain_process(
    mode: str, lora: bool, tmp_path: Path
) -> None:
    spawn_ranks(_rank, (mode, lora, str(tmp_path)), nprocs=2)
    gathered = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    plain = _trainer("off", None, lora)
    assert plain.packing_mode == "off"
    loss, grad_norm, logprobs = _step(plain)
    for _, rank_loss, rank_norm, rank_logprobs in gathered:
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        assert rank_norm == pytest.approx(grad_norm, rel=1e-5)
        for row, rank_row in zip(logprobs, rank_logprobs, strict=True):
            assert rank_row == pytest.approx(row, rel=1e-5, abs=1e-6)
