"""A GRPO run while it trains (``Run``: what the loops hold), and its folder: the layout,
checkpoints and resume of ``runs/directory.py``, with a ``GRPOConfig`` in config.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from post_training_cookbook.distill.types import Teacher
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.lazy import module_getattr
from post_training_cookbook.rollout import EpisodeRunner
from post_training_cookbook.runs import directory
from post_training_cookbook.runs.directory import LoopState as SavedLoopState
from post_training_cookbook.runs.reporting import RunLog
from post_training_cookbook.runs.stopping import StopRequest
from post_training_cookbook.service.base import ModelService


class RunDirectory(directory.RunDirectory):
    """A GRPO run's folder: config.yaml loads back with ``GRPOConfig.from_yaml``."""

    config_type = GRPOConfig


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
    resumed: SavedLoopState | None
    """The loop state of the checkpoint the run resumes from."""
    teacher: Teacher | None = None
    """On-policy distillation's teacher (``settings.teacher``), opened with the run."""
    stop: StopRequest = field(default_factory=StopRequest)
    """Set when a scheduler asks the run to stop (SIGTERM): the loop stops after the step it
    is in, saved (``runs/stopping.py``)."""

    @property
    def start_step(self) -> int:
        return self.resumed.step if self.resumed else 0


_MOVED_TO_RUNS = {
    "LoopState",
    "RunConfig",
    "resume_from_checkpoint",
    "LOOP_STATE",
    "COMPLETE",
    "RESUME_MUST_MATCH",
    "RESUME_LORA_MUST_MATCH",
}
# ``LoopState`` is imported above as ``SavedLoopState``: under its own name it stays a moved
# name of this module, read with a warning
__getattr__ = module_getattr(
    __name__, moved=dict.fromkeys(_MOVED_TO_RUNS, "post_training_cookbook.runs.directory")
)
