"""One PNG of a run's ``metrics.jsonl``: reward, validation reward, how episodes end, timings.
A mixture run's envs get a dashed reward line each, in both reward panels.

    post-training-cookbook plot runs/my-run          # writes runs/my-run/plots.png

or from Python, ``save_run_plot("runs/my-run")``; ``plot_run`` returns the matplotlib
figure, whose axes are titled ``PANEL_TITLES``. The PNG's text chunks name the run and the
panels (``Title``, ``Panels``). matplotlib (the ``plot`` extra) renders with the Agg
backend, so no display is needed.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PANEL_TITLES = ("Reward", "Validation reward", "How episodes end", "Timings")
CAUSE_KEYS = {
    "terminated": "rollout/terminated_ratio",
    "context overflow": "rollout/context_overflow_ratio",
    "max turns": "rollout/max_turns_ratio",
    "env truncated": "rollout/env_truncated_ratio",
    "parse failure": "rollout/parse_failure_ratio",
}
TIMING_KEYS = {
    "rollout": "time/rollout",
    "train": "time/train",
    "weight sync": "time/weight_sync",
    "validation": "time/validation",
    "async wait": "async/train_wait_s",
}
Metrics = dict[str, float]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[Metrics]:
    """One record per step, in step order (lines of the same step merged, later wins)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: not a run directory")
    by_step: dict[int, Metrics] = {}
    from post_training_cookbook.runs.checks import metric_steps

    metric_steps(path)  # a garbled line is an error naming it (a last line cut short is not)
    text = path.read_bytes().decode("utf-8", errors="replace")
    for line in text.splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:  # the last line, cut short by a kill
                continue
            step = record["step"]
            values = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
            by_step.setdefault(step, {}).update(values)
    return [by_step[step] for step in sorted(by_step)]


def plot_run(run_dir: str | os.PathLike[str]) -> Figure:
    """The run's 2×2 figure, panels titled ``PANEL_TITLES`` (an SFT run's: its loss,
    ``sft/plots.py``)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(
            "plots need matplotlib: pip install 'post-training-cookbook[plot]'"
        ) from exc

    records = read_metrics(run_dir)
    from post_training_cookbook.sft.plots import is_sft_run, plot_sft_records

    if is_sft_run(records):  # no rewards to draw: the loss instead
        return plot_sft_records(records, Path(run_dir).resolve().name)
    figure = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    reward, validation, causes, timings = figure.subplots(2, 2).flatten()
    _reward_panel(reward, records)
    _validation_panel(validation, records)
    _causes_panel(causes, records)
    _timings_panel(timings, records)
    for axes, title in zip((reward, validation, causes, timings), PANEL_TITLES, strict=True):
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(Path(run_dir).resolve().name)
    return figure


def save_run_plot(
    run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> Path:
    """Write the figure as a PNG (default ``<run>/plots.png``) and return its path."""
    figure = plot_run(run_dir)
    target = Path(out) if out is not None else Path(run_dir) / "plots.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Title": Path(run_dir).resolve().name, "Panels": "; ".join(PANEL_TITLES)}
    figure.savefig(target, format="png", metadata=metadata)
    return target


def _series(records: Sequence[Metrics], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
    return [step for step, _ in points], [value for _, value in points]


def env_names(records: Sequence[Metrics], prefix: str = "rollout/") -> list[str]:
    """The envs of a mixture run, from its per-env keys (``rollout/<env>/reward_mean``)."""
    found = {
        match.group(1)
        for record in records
        for key in record
        if (match := re.fullmatch(re.escape(prefix) + r"([^/]+)/reward_mean", key))
    }
    return sorted(found - {"env"})  # rollout/env/… are the envs' own metrics


def _reward_panel(axes: Axes, records: Sequence[Metrics]) -> None:
    steps, means = _series(records, "rollout/reward_mean")
    if not steps:
        _empty(axes, "no training steps yet")
        return
    axes.plot(steps, means, marker="o", markersize=3, label="mean")
    std_steps, stds = _series(records, "rollout/reward_std")
    if std_steps == steps:
        low = [m - s for m, s in zip(means, stds, strict=True)]
        high = [m + s for m, s in zip(means, stds, strict=True)]
        axes.fill_between(steps, low, high, alpha=0.2, label="± std")
    _reward_limits(axes, means + _per_env_lines(axes, records, "rollout/"))
    axes.set_ylabel("reward")
    axes.legend(loc="best", fontsize="small")


def _validation_panel(axes: Axes, records: Sequence[Metrics]) -> None:
    steps, means = _series(records, "val/reward_mean")
    if not steps:
        _empty(axes, "no validation in this run")
        return
    axes.plot(steps, means, marker="o", color="tab:green", label="val/reward_mean")
    _reward_limits(axes, means + _per_env_lines(axes, records, "val/"))
    axes.set_ylabel("reward")
    axes.legend(loc="best", fontsize="small")


def _per_env_lines(axes: Axes, records: Sequence[Metrics], prefix: str) -> list[float]:
    """A mixture's envs, one dashed line each, labelled by name; the values drawn."""
    drawn: list[float] = []
    for name in env_names(records, prefix):
        steps, means = _series(records, f"{prefix}{name}/reward_mean")
        axes.plot(steps, means, linestyle="--", marker=".", linewidth=1, label=name)
        drawn += means
    return drawn


def _causes_panel(axes: Axes, records: Sequence[Metrics]) -> None:
    present = {name: key for name, key in CAUSE_KEYS.items() if _series(records, key)[0]}
    if not present:
        _empty(axes, "no training steps yet")
        return
    rows = [r for r in records if CAUSE_KEYS["terminated"] in r]
    shares = [[r.get(key, 0.0) for r in rows] for key in present.values()]
    steps = [r["step"] for r in rows]
    axes.stackplot(steps, shares, labels=list(present), alpha=0.8)
    axes.set_ylim(0, 1)
    axes.set_ylabel("share of episodes")
    axes.legend(loc="lower left", fontsize="small")


def _timings_panel(axes: Axes, records: Sequence[Metrics]) -> None:
    drawn = 0
    for name, key in TIMING_KEYS.items():
        steps, seconds = _series(records, key)
        if steps:
            axes.plot(steps, seconds, marker="o", markersize=3, label=name)
            drawn += 1
    if not drawn:
        _empty(axes, "no timings recorded")
        return
    axes.set_ylabel("seconds per step")
    axes.legend(loc="best", fontsize="small")


def _reward_limits(axes: Axes, values: Sequence[float]) -> None:
    """At least [0, 1], the usual reward range, so a flat line at 0 reads as 0."""
    axes.set_ylim(min(0.0, *values) - 0.05, max(1.0, *values) + 0.05)


def _empty(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, color="gray")
