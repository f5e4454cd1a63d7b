"""The learning curve of a run: validation success against wall-clock minutes and steps.

    python scripts/plot_learning_curve.py runs/<run_name> [--out docs/learning_curve.png]

Reads only ``metrics.jsonl``. Wall-clock time is the run's own: the sum of its steps'
``time/step`` and ``time/validation`` (model loading excluded).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from post_training_cookbook.plots import read_metrics


def learning_curve(run_dir: Path) -> tuple[list[float], list[int], list[float], list[float]]:
    """(minutes, steps, validation reward, training reward) at each validation."""
    minutes, steps, val, train = [], [], [], []
    elapsed = 0.0
    last_train = float("nan")
    for record in read_metrics(run_dir):
        elapsed += float(record.get("time/validation") or 0.0)
        if "val/reward_mean" in record:
            minutes.append(elapsed / 60)
            steps.append(int(record["step"]))
            val.append(float(record["val/reward_mean"]))
            train.append(last_train)
        elapsed += float(record.get("time/step") or 0.0)
        last_train = float(record.get("rollout/reward_mean", last_train))
    return minutes, steps, val, train


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/learning_curve.png"))
    args = parser.parse_args(argv)
    minutes, steps, val, _ = learning_curve(args.run)
    if not val:
        print(f"{args.run}: no validation lines in metrics.jsonl", file=sys.stderr)
        return 1
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(minutes, val, marker="o", label="validation success (unseen entities)")
    for minute, step, value in zip(minutes, steps, val, strict=True):
        axes.annotate(
            f"step {step}", (minute, value), fontsize=7, xytext=(3, -10), textcoords="offset points"
        )
    axes.set_xlabel("wall-clock minutes (2 CPU cores)")
    axes.set_ylabel("success rate")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.set_title(f"GRPO on the tool-use game: {args.run.name}")
    axes.legend(loc="lower right")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    for minute, step, value in zip(minutes, steps, val, strict=True):
        print(f"{minute:6.1f} min  step {step:4d}  val success {value:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
