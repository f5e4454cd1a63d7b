"""Where step metrics go: metrics.jsonl, W&B (optional) and the console (``RunLog``); and
the names a training call's results go under there (``training_metrics``)."""

from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from post_training_cookbook.runs.directory import RunDirectory
from post_training_cookbook.trainer.types import ForwardBackwardResult, OptimStepResult


def training_metrics(result: ForwardBackwardResult, step: OptimStepResult) -> dict[str, float]:
    """A step's ``forward_backward`` and ``optim_step`` results as every loop logs them: the
    loss's token means (``loss/…``, ``docs/losses.md``), then the results' typed counts under
    their names: the optimizer step (``optim/…``), the positions the model computed
    (``train/forwarded_tokens``) and, with router replay, ``router/…``."""
    metrics = {
        **result.metrics,
        "optim/grad_norm": step.grad_norm,
        "optim/learning_rate": step.learning_rate,
        "optim/skipped": float(step.skipped),
        "train/forwarded_tokens": float(result.forwarded_tokens),
    }
    if result.router is not None:
        metrics["router/disagreement"] = result.router.disagreement
        metrics["router/replayed_tokens"] = float(result.router.replayed_tokens)
    return metrics


class RunLog:
    """Records each step's metrics, with ``time/elapsed``, in metrics.jsonl, W&B and the
    console's progress bar."""

    def __init__(
        self, directory: RunDirectory, wandb: WandbLogger, progress: ConsoleProgress
    ) -> None:
        self._directory = directory
        self._wandb = wandb
        self._progress = progress
        self._started = time.perf_counter()

    def record(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """``advance=False``: a record that is not a step (the final validation)."""
        metrics = {**metrics, "time/elapsed": time.perf_counter() - self._started}
        self._directory.append_metrics({"step": step, **metrics})
        self._wandb.log(metrics, step=step)
        if advance:
            self._progress.update(metrics)

    def note(self, text: str) -> None:
        self._progress.note(text)


class WandbLogger:
    """A W&B run in ``project``; wandb is imported only when a project is set (not None)."""

    def __init__(
        self,
        project: str | None,
        run_name: str,
        run_dir: str,
        config: dict[str, Any],
        *,
        resume: bool,
    ) -> None:
        self._run: Any = None
        if project is None:
            return
        import wandb

        self._run = wandb.init(
            project=project,
            name=run_name,
            id=run_name,
            dir=run_dir,
            config=config,
            resume="allow" if resume else None,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

    def finish(self, failed: bool = False) -> None:
        """Close the W&B run; ``failed`` marks it failed (exit code 1), as a crash should."""
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)


class ConsoleProgress:
    """A progress bar with the latest reward, validation reward and ETA."""

    def __init__(self, total: int, initial: int, run_name: str) -> None:
        self._bar = tqdm(
            total=total, initial=initial, desc=run_name, unit="step", dynamic_ncols=True
        )
        self._shown: dict[str, str] = {}

    def update(self, metrics: dict[str, float]) -> None:
        for key, label in (("rollout/reward_mean", "reward"), ("val/reward_mean", "val")):
            if key in metrics:
                self._shown[label] = f"{metrics[key]:.3f}"
        self._bar.set_postfix(self._shown, refresh=False)
        self._bar.update(1)

    def note(self, text: str) -> None:
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ConsoleProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
