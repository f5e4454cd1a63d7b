"""GRPOConfig cut into per-layer settings (``RunSettings.from_config``): every layer gets the
numbers of its config fields, and the derived values (learning rate, overlong penalty)."""

from __future__ import annotations

import pytest

from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import LearningRateSchedule, RunSettings
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings


def settings_of(**fields) -> RunSettings:
    return RunSettings.from_config(GRPOConfig(**fields), resolve_model(BUNDLED_MODEL_ID))


def schedule(**fields) -> LearningRateSchedule:
    return settings_of(**fields).steps.learning_rate


def test_a_constant_schedule_warms_up_linearly_then_holds() -> None:
    rates = schedule(learning_rate=1e-4, warmup_steps=4, num_steps=10)
    assert [rates.at(step) for step in range(4)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4])
    assert [rates.at(step) for step in range(4, 10)] == pytest.approx([1e-4] * 6)


def test_a_linear_schedule_decays_towards_zero_at_num_steps() -> None:
    rates = schedule(learning_rate=1.0, warmup_steps=2, num_steps=12, lr_schedule="linear")
    assert rates.at(1) == pytest.approx(1.0)
    assert rates.at(2) == pytest.approx(1.0)
    assert rates.at(7) == pytest.approx(0.5)
    assert rates.at(11) == pytest.approx(0.1)
    assert rates.at(12) == pytest.approx(0.0)


def test_a_cosine_schedule_halves_midway_and_stays_at_zero_past_the_end() -> None:
    rates = schedule(learning_rate=1.0, num_steps=10, lr_schedule="cosine")
    assert rates.at(0) == pytest.approx(1.0)
    assert rates.at(5) == pytest.approx(0.5)
    assert rates.at(10) == pytest.approx(0.0)
    assert rates.at(50) == pytest.approx(0.0)
    values = [rates.at(step) for step in range(10)]
    assert values == sorted(values, reverse=True)


def test_a_negative_step_has_no_learning_rate() -> None:
    with pytest.raises(ValueError, match="step"):
        schedule().at(-1)


def test_the_loss_settings_carry_the_loss_fields() -> None:
    loss = settings_of(
        loss_type="dr_grpo", clip_low=0.1, clip_high=0.28, kl_beta=0.05, tis_cap=3.0,
        dr_grpo_horizon=1536,
    ).steps.loss  # fmt: skip
    assert loss == LossConfig(
        loss_type="dr_grpo", clip_low=0.1, clip_high=0.28, kl_beta=0.05, tis_cap=3.0,
        dr_grpo_horizon=1536,
    )  # fmt: skip


def test_the_overlong_penalty_ramps_over_the_buffer_before_max_model_length() -> None:
    shaping = settings_of(max_model_length=1000, overlong_buffer_length=200).steps.advantages
    penalty = shaping.shaping.overlong_penalty
    assert penalty(800) == 0.0
    assert penalty(900) == pytest.approx(-0.5)
    assert penalty(1000) == pytest.approx(-1.0)
    assert penalty(5000) == pytest.approx(-1.0)
    off = settings_of(overlong_buffer_length=0).steps.advantages.shaping
    assert off.overlong_penalty(10_000) == 0.0
    flat = settings_of(overlong_penalty_factor=0.0).steps.advantages.shaping
    assert flat.overlong_penalty(10_000) == 0.0


def test_episode_limits_and_sampling_params_carry_the_config() -> None:
    settings = settings_of(
        max_turns=3, max_model_length=1024, max_tokens_per_turn=128, failed_parse_reward=-1.0,
        env_step_timeout_s=None, env_errors="retry", env_retry_attempts=4, temperature=0.8,
        val_temperature=0.0, top_p=0.9,
    )  # fmt: skip
    limits = settings.episodes
    assert (limits.max_turns, limits.max_model_length, limits.max_tokens_per_turn) == (
        3,
        1024,
        128,
    )
    assert (limits.failed_parse_reward, limits.env_step_timeout_s, limits.env_errors) == (
        -1.0,
        None,
        "retry",
    )
    assert limits.env_retry_attempts == limits.retries == 4
    train, val = settings.train_sampling, settings.val_sampling
    assert (train.max_tokens, train.temperature, train.top_p) == (128, 0.8, 0.9)
    assert (val.max_tokens, val.temperature, val.top_p) == (128, 0.0, 0.9)


def test_the_service_spec_carries_typed_trainer_settings_and_placement() -> None:
    settings = settings_of(
        use_lora=False, lora_rank=4, lora_alpha=8, lora_dropout=0.1, weight_decay=0.01,
        max_grad_norm=0.5, micro_batch_tokens=1024, kl_beta=0.1, seed=7,
        num_generator_replicas=2, dtype="bfloat16", max_steps_off_policy=1,
        gradient_checkpointing=True, logprob_chunk_tokens=256, trainer_precision="bf16",
    )  # fmt: skip
    spec = settings.service
    assert spec.trainer == TrainerSettings(
        use_lora=False, lora_rank=4, lora_alpha=8, lora_dropout=0.1, weight_decay=0.01,
        max_grad_norm=0.5, micro_batch_tokens=1024, reference_model=True, seed=7,
        gradient_checkpointing=True, logprob_chunk_tokens=256, precision="bf16",
    )  # fmt: skip
    assert (spec.backend, spec.num_generator_replicas, spec.dtype) == ("local", 2, "bfloat16")
    assert spec.overlapped  # async: the cores are split between trainer and generators
    assert spec.model.model_id == BUNDLED_MODEL_ID
    assert settings_of().service.dtype == "float32"  # the bundled model's default
    assert not settings_of().service.overlapped


def test_the_service_spec_carries_the_sharded_trainer_and_its_weight_transport() -> None:
    spec = settings_of(
        backend="ray", num_trainer_workers=2, collective_timeout_s=30.0,
        weight_transport="broadcast", generation_engine="torch",
    ).service  # fmt: skip
    assert (spec.num_trainer_workers, spec.collective_timeout_s) == (2, 30.0)
    assert spec.weight_transport == "broadcast"
    defaults = settings_of().service
    assert (defaults.num_trainer_workers, defaults.weight_transport) == (1, "auto")


def test_a_lockstep_config_has_no_async_settings_and_an_async_one_has_its_shape() -> None:
    assert settings_of().async_ is None
    shape = settings_of(batch_size=4, max_steps_off_policy=1, groups_in_flight=8).async_
    assert shape is not None and (shape.max_steps_off_policy, shape.groups_in_flight) == (1, 8)
    default = settings_of(batch_size=4, max_steps_off_policy=2).async_
    assert default is not None and default.groups_in_flight == 4


def test_the_schedule_says_when_to_validate_and_checkpoint() -> None:
    schedule_ = settings_of(num_steps=7, validation_interval=3, checkpoint_interval=5).schedule
    assert [s for s in range(7) if schedule_.validation_due(s)] == [0, 3, 6]
    assert [s for s in range(1, 8) if schedule_.checkpoint_due(s)] == [5, 7]  # 7: the end
