"""Every loss variant's value, gradient and metrics on fixed inputs, pinned to the numbers the
losses gave before they were rewritten as one objective module (issue 57): a rewrite that
changes any of them by more than float64 rounding fails here.

The inputs are float64 and made from sines (no random generator): four sequences of seven
positions, one with no trained token, advantages of both signs, ratios inside and outside
every clip. Each case is one ``LossConfig`` (with TIS, the trainer's old log-probabilities
differ from the current ones; with KL, a reference is given), on the whole batch and on its
halves with the whole batch's totals. ``python tests/test_losses_pinned.py`` rewrites
``tests/data/losses_pinned.json`` from the losses as they are (only ever on purpose).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from post_training_cookbook.trainer.objective import BatchTotals, get_loss_fn
from post_training_cookbook.trainer.types import TRAINER_LOSS_TYPES, LossConfig

PINNED = Path(__file__).parent / "data" / "losses_pinned.json"
ROWS, POSITIONS = 4, 7
TOLERANCE = 1e-12  # float64: only a changed order of additions may move a digit

KNOBS: dict[str, dict[str, Any]] = {
    "plain": {},
    "clip_higher": {"clip_low": 0.1, "clip_high": 0.28},
    "tight_clip": {"clip_low": 0.05, "clip_high": 0.05},
    "tis": {"tis_cap": 1.3},
    "kl": {"kl_beta": 0.07},
    "tis_kl": {"tis_cap": 2.0, "kl_beta": 0.2},
    "horizon": {"dr_grpo_horizon": 9},
}


def inputs() -> dict[str, torch.Tensor]:
    index = torch.arange(ROWS * POSITIONS, dtype=torch.float64).reshape(ROWS, POSITIONS)
    rows = [[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0] * 7, [0, 1, 0, 1, 1, 0, 1]]
    mask = torch.tensor(rows, dtype=torch.float64)
    logprobs = -1.5 + torch.sin(index * 1.3)
    sampler = (logprobs - 0.4 * torch.sin(index * 0.7 + 0.3)) * mask
    trainer_old = logprobs + 0.15 * torch.cos(index * 0.9)
    reference = logprobs + 0.3 * torch.sin(index * 0.5 + 1.0)
    row_advantage = torch.tensor([[1.2], [-0.7], [0.4], [-1.9]], dtype=torch.float64)
    advantages = (row_advantage + 0.1 * torch.cos(index)) * mask
    return {"logprobs": logprobs, "sampler": sampler, "trainer_old": trainer_old,
            "reference": reference, "advantages": advantages, "mask": mask}  # fmt: skip


def run_case(loss_type: str, knobs: dict[str, Any], rows: slice) -> dict[str, Any]:
    """Loss, gradient and metrics of ``rows`` of the batch, normalised by the whole batch."""
    config = LossConfig(loss_type=loss_type, **knobs)  # type: ignore[arg-type]
    x = inputs()
    logprobs = x["logprobs"].clone().requires_grad_(True)
    loss, metrics = get_loss_fn(loss_type)(
        logprobs[rows], x["sampler"][rows], x["advantages"][rows], x["mask"][rows], config,
        reference_logprobs=x["reference"][rows] if config.kl_beta > 0 else None,
        trainer_old_logprobs=x["trainer_old"][rows] if config.tis_cap is not None else None,
        totals=BatchTotals.of(x["mask"]),
    )  # fmt: skip
    loss.backward()
    assert logprobs.grad is not None
    return {"loss": loss.item(), "grad": logprobs.grad.tolist(), "metrics": metrics}


def cases() -> list[tuple[str, str, str]]:
    return [
        (loss_type, knob, part)
        for loss_type in TRAINER_LOSS_TYPES
        for knob in KNOBS
        for part in ("whole", "first_half", "second_half")
    ]


PARTS = {"whole": slice(0, ROWS), "first_half": slice(0, 2), "second_half": slice(2, ROWS)}


def compute_all() -> dict[str, Any]:
    return {
        f"{loss_type}/{knob}/{part}": run_case(loss_type, KNOBS[knob], PARTS[part])
        for loss_type, knob, part in cases()
    }


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    return dict(json.loads(PINNED.read_text()))


@pytest.mark.parametrize(("loss_type", "knob", "part"), cases())
def test_each_loss_gives_the_pinned_value_gradient_and_metrics(
    pinned: dict[str, Any], loss_type: str, knob: str, part: str
) -> None:
    want = pinned[f"{loss_type}/{knob}/{part}"]
    got = run_case(loss_type, KNOBS[knob], PARTS[part])
    assert math.isclose(got["loss"], want["loss"], rel_tol=TOLERANCE, abs_tol=TOLERANCE)
    torch.testing.assert_close(
        torch.tensor(got["grad"]), torch.tensor(want["grad"]), rtol=TOLERANCE, atol=TOLERANCE
    )
    assert got["metrics"].keys() == want["metrics"].keys()
    for key, value in want["metrics"].items():
        assert math.isclose(got["metrics"][key], value, rel_tol=TOLERANCE, abs_tol=TOLERANCE), key


def test_the_pinned_file_covers_every_case_and_no_other(pinned: dict[str, Any]) -> None:
    assert set(pinned) == {f"{t}/{k}/{p}" for t, k, p in cases()}


if __name__ == "__main__":
    lines = [f"{json.dumps(key)}: {json.dumps(value)}" for key, value in compute_all().items()]
    PINNED.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one case a line
    print(f"wrote {PINNED}")
