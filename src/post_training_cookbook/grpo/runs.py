"""A run while it trains (``Run``: what the loops hold), and its directory:

runs/<run_name>/
    config.yaml                       the whole config (loads back with GRPOConfig.from_yaml)
    metrics.jsonl                     one line per step (with that step's validation, if
                                      any), then one for the final validation
    rollouts/train_step_000012.jsonl  every episode of step 12: messages, reward, cause, tokens
    rollouts/val_step_000010.jsonl    every episode of the validation before step 10
    checkpoints/step_000010/          training checkpoint + loop_state.json (written last)
    final_model/                      inference checkpoint: AutoModelForCausalLM.from_pretrained
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.rollout import EpisodeRunner, Group, episode_record
from post_training_cookbook.service.base import ModelService

if TYPE_CHECKING:
    from post_training_cookbook.grpo.reporting import RunLog
    from post_training_cookbook.grpo.settings import RunSettings

LOOP_STATE = "loop_state.json"


@dataclass(frozen=True)
class LoopState:
    """What the loop needs, beyond the trainer's checkpoint, to continue a run exactly."""

    step: int
    """Steps completed."""
    task_cursor: int
    """Lockstep: tasks handed out. Async: the lowest task position not yet done."""
    run_name: str
    done_positions: list[int] = field(default_factory=list)
    """Async only: task positions above ``task_cursor`` already done (see async_loop)."""


@dataclass
class Run:
    """What the loops hold while a run trains (opened by ``train.open_run``)."""

    name: str
    settings: RunSettings
    service: ModelService
    episodes: EpisodeRunner
    train_params: SamplingParams
    """The codec's stop tokens included, as every sampling param below."""
    val_params: SamplingParams
    directory: RunDirectory
    log: RunLog
    resumed: LoopState | None
    """The loop state of the checkpoint the run resumes from."""

    @property
    def start_step(self) -> int:
        return self.resumed.step if self.resumed else 0


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.metrics_path = path / "metrics.jsonl"
        self.rollouts_dir = path / "rollouts"
        self.checkpoints_dir = path / "checkpoints"
        self.final_model_dir = path / "final_model"

    def create(self, config: GRPOConfig) -> None:
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(self.path / "config.yaml")

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as file:
            file.write(json.dumps(_finite(record)) + "\n")

    def drop_metrics_from(self, step: int) -> None:
        """On resume: drop the lines of step ``step`` and later, which the checkpoint (after
        ``step`` completed steps) does not contain; the resumed run writes them again. A
        line the kill cut short is dropped too."""
        if not self.metrics_path.exists():
            return
        kept = [
            line
            for line in self.metrics_path.read_text().splitlines()
            if (line_step := _step_of(line)) is not None and line_step < step
        ]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def dump_rollouts(self, step: int, groups: Sequence[Group], kind: str = "train") -> Path:
        path = self.rollouts_dir / f"{kind}_step_{step:06d}.jsonl"
        with path.open("w") as file:
            for group_index, group in enumerate(groups):
                for episode in group.episodes:
                    record = {"step": step, "group": group_index, **episode_record(episode)}
                    file.write(json.dumps(record, default=str) + "\n")
        return path

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:06d}"

    def write_loop_state(self, checkpoint: Path, state: LoopState) -> None:
        # written last: a checkpoint folder without it is an interrupted save
        temporary = checkpoint / (LOOP_STATE + ".tmp")
        temporary.write_text(json.dumps(state.__dict__))
        os.replace(temporary, checkpoint / LOOP_STATE)

    def last_checkpoint(self) -> tuple[Path, LoopState] | None:
        if not self.checkpoints_dir.is_dir():
            return None
        complete = sorted(
            folder for folder in self.checkpoints_dir.iterdir() if (folder / LOOP_STATE).is_file()
        )
        if not complete:
            return None
        state = json.loads((complete[-1] / LOOP_STATE).read_text())
        return complete[-1], LoopState(**state)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return int(record.get("step", 0)) if isinstance(record, dict) else None


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: write them as null."""
    return {
        key: (None if isinstance(value, float) and not math.isfinite(value) else value)
        for key, value in record.items()
    }
