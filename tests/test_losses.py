"""The objective's policy-gradient loss, each variant against numbers worked out by hand, and
their gradients.

The shared batch: two sequences, four positions each (position 0 never trained).

    sequence 0: mask 0 1 1 0, A = +1, ratio r = π/π_old = 1.5, 0.9 on the trained tokens
    sequence 1: mask 0 1 1 1, A = −2, ratio r = 0.5, 1.1, 1.3

With ε_low = ε_high = 0.2 the per-token PPO terms −min(r·A, clip(r)·A) are
    sequence 0: −1.2 (1.5 clipped to 1.2), −0.9
    sequence 1: +1.6 (0.5 clipped to 0.8: the min picks 0.8·−2), +2.2, +2.6 (1.3 is not
    clipped for a negative advantage: min(−2.6, −2.4) = −2.6)
"""

from __future__ import annotations

import math

import pytest
import torch

from post_training_cookbook.service.types import WeightSyncType
from post_training_cookbook.trainer.objective import (
    BatchTotals,
    LossFn,
    get_loss_fn,
    policy_loss,
)
from post_training_cookbook.trainer.types import LossConfig, TrainingSample

MASK = [[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
ADVANTAGES = [[0.0, 1.0, 1.0, 0.0], [0.0, -2.0, -2.0, -2.0]]
RATIOS = [[1.0, 1.5, 0.9, 1.0], [1.0, 0.5, 1.1, 1.3]]
LOGPROBS = [[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -1.5, -3.0]]
TERMS = {(0, 1): -1.2, (0, 2): -0.9, (1, 1): 1.6, (1, 2): 2.2, (1, 3): 2.6}


def make_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor(MASK)
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor(LOGPROBS, dtype=torch.float64) - torch.tensor(RATIOS).double().log()
    sampler = sampler * mask  # the convention: 0 off the mask
    return logprobs, sampler, torch.tensor(ADVANTAGES, dtype=torch.float64), mask.double()


def loss_and_grad(
    loss_fn: LossFn,
    config: LossConfig,
    reference_logprobs: torch.Tensor | None = None,
    trainer_old_logprobs: torch.Tensor | None = None,
) -> tuple[float, dict[str, float], torch.Tensor]:
    assert get_loss_fn(config.loss_type) is loss_fn  # the variant the config picks
    logprobs, sampler, advantages, mask = make_batch()
    loss, metrics = loss_fn(
        logprobs, sampler, advantages, mask, config,
        reference_logprobs=reference_logprobs, trainer_old_logprobs=trainer_old_logprobs,
    )  # fmt: skip
    loss.backward()
    assert logprobs.grad is not None
    return loss.item(), metrics, logprobs.grad


def test_grpo_averages_tokens_within_each_sequence_then_sequences() -> None:
    loss, metrics, grad = loss_and_grad(policy_loss, LossConfig(loss_type="grpo"))
    expected = ((-1.2 - 0.9) / 2 + (1.6 + 2.2 + 2.6) / 3) / 2
    assert loss == pytest.approx(expected)
    assert metrics["loss/clip_high_fraction"] == pytest.approx(1 / 5)  # r=1.5 with A>0
    assert metrics["loss/clip_low_fraction"] == pytest.approx(1 / 5)  # r=0.5 with A<0
    abs_log_ratios = [abs(math.log(r)) for r in (1.5, 0.9, 0.5, 1.1, 1.3)]
    assert metrics["loss/sampler_trainer_abs_diff"] == pytest.approx(sum(abs_log_ratios) / 5)
    # d/dlogπ of −r·A is −r·A, times the token's weight 1/(G·|o_i|).
    assert grad[0, 2].item() == pytest.approx(-0.9 * 1 / (2 * 2))
    assert grad[1, 2].item() == pytest.approx(2.2 / (2 * 3))
    assert grad[1, 3].item() == pytest.approx(2.6 / (2 * 3))


def test_grpo_clipped_tokens_and_masked_positions_get_zero_gradient() -> None:
    _, _, grad = loss_and_grad(policy_loss, LossConfig(loss_type="grpo"))
    assert grad[0, 1].item() == 0.0  # r=1.5 > 1.2 with A>0
    assert grad[1, 1].item() == 0.0  # r=0.5 < 0.8 with A<0
    assert grad[0, 0].item() == grad[0, 3].item() == grad[1, 0].item() == 0.0


def test_grpo_gradient_sign_follows_the_advantage() -> None:
    _, _, grad = loss_and_grad(policy_loss, LossConfig(loss_type="grpo", clip_low=1.0, clip_high=9))
    # Gradient descent moves log π against the gradient: up for A>0, down for A<0.
    assert (grad[0, 1:3] < 0).all()
    assert (grad[1, 1:4] > 0).all()


def test_dapo_averages_over_all_trained_tokens_of_the_batch() -> None:
    loss, _, grad = loss_and_grad(policy_loss, LossConfig(loss_type="dapo", clip_high=0.28))
    # clip-higher: 1.5 is now clipped to 1.28; 1.3 with A<0 is unclipped either way.
    expected = (-1.28 - 0.9 + 1.6 + 2.2 + 2.6) / 5
    assert loss == pytest.approx(expected)
    assert grad[1, 3].item() == pytest.approx(2.6 / 5)


def test_dr_grpo_divides_sequence_sums_by_a_fixed_horizon() -> None:
    total = sum(TERMS.values())
    loss, _, grad = loss_and_grad(policy_loss, LossConfig(loss_type="dr_grpo"))
    assert loss == pytest.approx(total / (2 * 3))  # default horizon: longest, 3 tokens
    assert grad[0, 2].item() == pytest.approx(-0.9 / (2 * 3))  # no per-sequence length
    fixed, _, _ = loss_and_grad(policy_loss, LossConfig(loss_type="dr_grpo", dr_grpo_horizon=10))
    assert fixed == pytest.approx(total / (2 * 10))


def test_gspo_uses_one_geometric_mean_ratio_per_sequence() -> None:
    loss, metrics, grad = loss_and_grad(policy_loss, LossConfig(loss_type="gspo"))
    s0 = math.sqrt(1.5 * 0.9)  # 1.1619: inside [0.8, 1.2]
    s1 = (0.5 * 1.1 * 1.3) ** (1 / 3)  # 0.8942
    assert loss == pytest.approx((-s0 * 1 + s1 * 2) / 2)
    assert metrics["loss/clip_high_fraction"] == 0.0
    # d/dlogπ_t of −s_i·A_i is −s_i·A_i/|o_i| on every token of the sequence, then 1/G.
    assert grad[0, 1].item() == pytest.approx(grad[0, 2].item())
    assert grad[0, 1].item() == pytest.approx(-s0 / 2 / 2)
    assert grad[1, 3].item() == pytest.approx(s1 * 2 / 3 / 2)


def test_gspo_clips_whole_sequences_and_zeroes_their_gradient() -> None:
    config = LossConfig(loss_type="gspo", clip_low=0.05, clip_high=0.05)
    loss, metrics, grad = loss_and_grad(policy_loss, config)
    assert loss == pytest.approx((-1.05 + 1.9) / 2)  # s0 → 1.05 (A>0), s1 → 0.95 (A<0)
    assert metrics["loss/clip_high_fraction"] == pytest.approx(2 / 5)  # sequence 0's tokens
    assert metrics["loss/clip_low_fraction"] == pytest.approx(3 / 5)
    assert torch.count_nonzero(grad) == 0


def test_cispo_weights_reinforce_by_a_capped_stop_gradient_ratio() -> None:
    loss, metrics, grad = loss_and_grad(policy_loss, LossConfig(loss_type="cispo"))
    weights = {(0, 1): 1.2, (0, 2): 0.9, (1, 1): 0.5, (1, 2): 1.1, (1, 3): 1.2}
    expected = sum(
        -w * ADVANTAGES[i][t] * LOGPROBS[i][t] for (i, t), w in weights.items()
    ) / 5  # fmt: skip
    assert loss == pytest.approx(expected)  # = −1.6
    assert expected == pytest.approx(-1.6)
    assert metrics["loss/clip_high_fraction"] == pytest.approx(2 / 5)
    assert metrics["loss/clip_low_fraction"] == 0.0
    # Capped tokens keep a gradient, only its size is capped: −w·A/N.
    assert grad[0, 1].item() == pytest.approx(-1.2 / 5)
    assert grad[1, 1].item() == pytest.approx(-0.5 * -2 / 5)


def test_k3_kl_to_the_reference_is_added_per_token() -> None:
    logprobs, _, _, mask = make_batch()
    reference = (logprobs.detach() + math.log(2.0)) * mask  # d = ln 2 on every trained token
    config = LossConfig(loss_type="grpo", kl_beta=0.1)
    loss, metrics, _ = loss_and_grad(policy_loss, config, reference_logprobs=reference)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert metrics["loss/kl_ref"] == pytest.approx(k3)
    assert loss == pytest.approx(((-2.1) / 2 + 6.4 / 3) / 2 + 0.1 * k3)


def test_kl_without_reference_logprobs_is_an_error() -> None:
    with pytest.raises(ValueError, match="reference_logprobs"):
        loss_and_grad(policy_loss, LossConfig(kl_beta=0.1))


def test_tis_weights_terms_by_the_capped_trainer_to_sampler_ratio() -> None:
    # The trainer's pre-update policy equals the current one, so the PPO ratio is 1 and
    # each token's term is −min(π_trainer/π_sampler, cap)·A.
    loss, metrics, grad = loss_and_grad(policy_loss, LossConfig(loss_type="grpo", tis_cap=1.2))
    weights = [[1.2, 0.9], [0.5, 1.1, 1.2]]
    assert loss == pytest.approx((-sum(weights[0]) / 2 + 2 * sum(weights[1]) / 3) / 2)
    assert metrics["loss/tis_weight_mean"] == pytest.approx(4.9 / 5)
    assert metrics["loss/clip_high_fraction"] == 0.0
    assert grad[0, 1].item() == pytest.approx(-1.2 / 4)  # weighted, never clipped to zero


def test_tis_uses_given_trainer_old_logprobs_for_the_ratio() -> None:
    sampler = make_batch()[1]
    config = LossConfig(loss_type="dapo", tis_cap=10.0)
    # Old trainer policy = sampler: TIS weight 1 and the ratio is r itself, as without TIS.
    with_tis, metrics, _ = loss_and_grad(policy_loss, config, trainer_old_logprobs=sampler)
    without, _, _ = loss_and_grad(policy_loss, LossConfig(loss_type="dapo"))
    assert with_tis == pytest.approx(without)
    assert metrics["loss/tis_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_summing_per_sequence_shares_gives_the_batch_loss_and_gradient(loss_type: str) -> None:
    config = LossConfig(loss_type=loss_type, kl_beta=0.05, tis_cap=1.4)  # type: ignore[arg-type]
    logprobs, sampler, advantages, mask = make_batch()
    reference = logprobs.detach() * 0.9
    loss_fn = get_loss_fn(loss_type)
    whole, _ = loss_fn(logprobs, sampler, advantages, mask, config, reference_logprobs=reference)
    whole.backward()
    assert logprobs.grad is not None
    whole_grad = logprobs.grad.clone()
    logprobs.grad = None
    totals = BatchTotals.of(mask)
    parts = [
        loss_fn(
            logprobs[i : i + 1], sampler[i : i + 1], advantages[i : i + 1], mask[i : i + 1],
            config, reference_logprobs=reference[i : i + 1], totals=totals,
        )[0]
        for i in range(2)
    ]  # fmt: skip
    sum(parts).backward()  # type: ignore[union-attr]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item())
    torch.testing.assert_close(logprobs.grad, whole_grad)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_values_off_the_mask_do_not_change_the_loss(loss_type: str) -> None:
    config = LossConfig(loss_type=loss_type)  # type: ignore[arg-type]
    logprobs, sampler, advantages, mask = make_batch()
    loss_fn = get_loss_fn(loss_type)
    clean, _ = loss_fn(logprobs, sampler, advantages, mask, config)
    noise = torch.full_like(mask, 3.0) * (1 - mask)
    noisy, _ = loss_fn(logprobs + noise, sampler - noise, advantages + noise, mask, config)
    assert noisy.item() == pytest.approx(clean.item())


def test_unknown_loss_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="loss_type"):
        get_loss_fn("ppo2")
    with pytest.raises(ValueError, match="loss_type"):
        LossConfig(loss_type="ppo2")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_low", -0.1),
        ("clip_low", 1.5),
        ("clip_high", -0.1),
        ("kl_beta", -1.0),
        ("tis_cap", 0.0),
        ("tis_cap", math.inf),
        ("dr_grpo_horizon", 0),
    ],
)
def test_loss_config_errors_name_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})  # type: ignore[arg-type]


def test_training_sample_checks_lengths_and_the_first_position() -> None:
    TrainingSample([1, 2, 3], [0.0, 1.0, 1.0], [0.0, -0.1, -0.2], [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="advantages"):
        TrainingSample([1, 2, 3], [0.0, 1.0, 1.0], [0.0, -0.1, -0.2], [0.0, 1.0])
    with pytest.raises(ValueError, match="mask"):
        TrainingSample([1, 2], [0.0, 1.0, 1.0], [0.0, -0.1], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"mask\[0\]"):
        TrainingSample([1, 2], [1.0, 1.0], [0.0, -0.1], [0.0, 1.0])


@pytest.mark.parametrize(
    "value",
    ["pipeline", "PIPELINE", "WEIGHT_SYNC_TYPE_PIPELINE", WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE],
)
def test_weight_sync_type_parses_members_names_and_short_names(value: object) -> None:
    assert WeightSyncType.parse(value) is WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE  # type: ignore[arg-type]


def test_weight_sync_type_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="synchronous"):
        WeightSyncType.parse("eventually")
