"""Settings no run can honour: ``groups_in_flight`` past what steps can train (10**6 made
no progress in 10 minutes), and temperatures so small that logits divided by them overflow
into NaN log-probabilities (1e-40 "completed" at reward 0): refused, saying why."""

from __future__ import annotations

import pytest

from post_training_cookbook.grpo.config import GRPOConfig


def test_groups_in_flight_beyond_what_steps_can_train_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match=r"groups_in_flight must be <= 32.*stale"):
        GRPOConfig(batch_size=4, max_steps_off_policy=1, groups_in_flight=1_000_000)
    with pytest.raises(ValueError, match=r"groups_in_flight must be <= 1024"):
        GRPOConfig(batch_size=64, max_steps_off_policy=100, groups_in_flight=10_000)
    assert GRPOConfig(batch_size=4, max_steps_off_policy=1, groups_in_flight=32)


@pytest.mark.parametrize("field", ["temperature", "val_temperature"])
@pytest.mark.parametrize("value", [1e-40, 1e-4, float("inf")])
def test_tiny_temperatures_are_refused_by_the_config(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**{field: value})
    assert getattr(GRPOConfig(**{field: 0.0}), field) == 0.0


def test_tiny_temperatures_are_refused_by_sampling_params() -> None:
    from post_training_cookbook.engine.types import SamplingParams

    for value in (1e-40, 5e-4):
        with pytest.raises(ValueError, match="temperature must be 0"):
            SamplingParams(temperature=value)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1e-300)
    assert SamplingParams(temperature=1e-3).temperature == 1e-3


def test_tiny_temperatures_are_refused_by_evaluation_settings() -> None:
    from post_training_cookbook.evaluation.results import EvalSettings

    with pytest.raises(ValueError, match="temperature must be 0"):
        EvalSettings(temperature=1e-40)
