"""The figure of an SFT run's ``metrics.jsonl`` (``post-training-cookbook plot`` draws it for a
run without rollouts): the training and validation loss, and the optimizer's step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SFT_PANEL_TITLES = ("Loss (mean NLL per trained token)", "Optimizer")
Metrics = dict[str, float]


def is_sft_run(records: Sequence[Metrics]) -> bool:
    """A run whose steps have an SFT loss and no rollouts."""
    keys = {key for record in records for key in record}
    return "loss/nll" in keys and not any(key.startswith("rollout/") for key in keys)


def plot_sft_records(records: Sequence[Metrics], title: str) -> Figure:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(12, 4.5), dpi=100, layout="constrained")
    loss, optimizer = figure.subplots(1, 2)
    for key, label in (("loss/nll", "train"), ("val/nll", "validation")):
        steps, values = _series(records, key)
        if steps:
            loss.plot(steps, values, marker="o" if key == "val/nll" else None, label=label)
    loss.legend()
    steps, norms = _series(records, "optim/grad_norm")
    optimizer.plot(steps, norms, label="grad norm (before clipping)")
    rates = optimizer.twinx()
    steps, values = _series(records, "optim/learning_rate")
    rates.plot(steps, values, color="tab:orange", label="learning rate")
    optimizer.legend(loc="upper left")
    rates.legend(loc="upper right")
    for axes, panel in zip((loss, optimizer), SFT_PANEL_TITLES, strict=True):
        axes.set_title(panel)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(title)
    return figure


def _series(records: Sequence[Metrics], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
    return [step for step, _ in points], [value for _, value in points]
