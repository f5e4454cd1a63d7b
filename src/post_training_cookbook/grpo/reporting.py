"""Where step metrics go besides metrics.jsonl: W&B (optional) and the console."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from post_training_cookbook.grpo.config import GRPOConfig


class WandbLogger:
    """W&B on ``config.wandb_project``; wandb is imported only when a project is set."""

    def __init__(self, config: GRPOConfig, run_dir: str, resume: bool) -> None:
        self._run: Any = None
        if config.wandb_project is None:
            return
        import wandb

        self._run = wandb.init(
            project=config.wandb_project,
            name=config.run_name,
            id=config.run_name,
            dir=run_dir,
            config=config.to_dict(),
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
