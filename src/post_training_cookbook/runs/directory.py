"""A run's directory, what every loop writes (GRPO's ``grpo/``, SFT's ``sft/``):

runs/<run_name>/
    config.yaml                       the whole config (loads back with the loop's config class)
    metrics.jsonl                     one line per step (with that step's validation, if
                                      any), then one for the final validation
    rollouts/train_step_000012.jsonl  every episode of step 12: messages, reward, cause, tokens
                                      with their mask and sampler log-probabilities (what
                                      grpo/recorded_batch.py rebuilds the step's batch from)
    rollouts/val_step_000010.jsonl    every episode of the validation before step 10
    checkpoints/step_000010/          training checkpoint, loop_state.json, complete.json
    final_model/                      inference checkpoint: AutoModelForCausalLM.from_pretrained

A checkpoint is written whole as ``checkpoints/step_000010.partial/`` (the trainer's files,
then ``loop_state.json``, then ``manifest.json`` with every file's sha256, then
``complete.json`` listing every file and its size; ``runs/checks.py``), fsynced,
and renamed to ``step_000010``: a folder of that name is complete. ``final_model`` is written
the same way. Resuming (``resume_from_checkpoint``) takes the newest checkpoint that reads
back whole, and says which ones it skipped and why; checkpoints of earlier versions (no
``complete.json``: ``loop_state.json`` marked them complete) still resume.

Nothing in an existing run folder changes before the resumed run has loaded: ``start``
writes config.yaml, drops the metrics lines past the checkpoint and removes what
interrupted saves left, and every loop calls it last (``runs/opening.py``). The ``Run`` a
GRPO loop holds while it trains is ``grpo/runs.py``'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from post_training_cookbook.files import (
    BadFileError,
    commit_folder,
    partial_folder,
    read_json_object,
    remove_stale,
    replace_file,
    temporary_sibling,
    write_text_atomic,
)
from post_training_cookbook.rollout import Group, episode_record
from post_training_cookbook.runs.checks import (
    check_manifest,
    check_run_folder,
    checkpoint_folders,
    step_of_line,
    write_manifest,
)
from post_training_cookbook.service.base import ModelService

LOOP_STATE = "loop_state.json"
COMPLETE = "complete.json"
"""Written last into a checkpoint: every file's size. Older checkpoints have none."""

RESUME_MUST_MATCH = ("model", "codec", "dtype", "use_lora", "seed")
"""Fields a resumed config must share with the run's config.yaml: the checkpoint's weights
belong to that model, codec and training mode, and the task order to that seed."""
RESUME_LORA_MUST_MATCH = ("lora_rank", "lora_alpha", "lora_dropout", "trainable_tokens")
"""The same, with LoRA: the adapter's shape and scale. Every other field may change."""


class RunConfig(Protocol):
    """What a run folder needs of its config: a loop's (``GRPOConfig``, ``SFTConfig``)."""

    @property
    def resume(self) -> bool: ...

    @property
    def resume_allow_missing_files(self) -> bool: ...

    @property
    def use_lora(self) -> bool: ...

    def to_yaml(self, path: Path) -> Path: ...

    def flat_values(self) -> dict[str, Any]: ...


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


class RunDirectory:
    """A run folder of one loop: each loop's subclass names its ``config_type``."""

    config_type: ClassVar[Any]
    """The loop's config class, whose ``from_yaml`` reads config.yaml back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config_path = path / "config.yaml"
        self.metrics_path = path / "metrics.jsonl"
        self.rollouts_dir = path / "rollouts"
        self.checkpoints_dir = path / "checkpoints"
        self.final_model_dir = path / "final_model"

    # ------------------------------------------------------------ starting and resuming

    def check_resumable(self, config: RunConfig) -> None:
        """Raise ``ValueError`` when ``config`` cannot continue this run: a field of
        ``RESUME_MUST_MATCH`` differs from config.yaml's, or config.yaml is unreadable."""
        check_run_folder(self.path, allow_missing_files=config.resume_allow_missing_files)
        saved = self.saved_config()
        if saved is None:
            return
        conflicts = [
            f"{name}={getattr(saved, name)!r} in the run, {getattr(config, name)!r} now"
            for name in _must_match(saved, config)
            if not _same_value(name, getattr(saved, name), getattr(config, name))
        ]
        if conflicts:
            raise ValueError(
                f"cannot resume {self.path}: " + "; ".join(conflicts) + " (these must match "
                "for its checkpoints to be valid; set them back, or start a new run_name)"
            )

    def saved_config(self) -> RunConfig | None:
        """The run's config.yaml, None when it has none yet."""
        if not self.config_path.exists():
            return None
        if self.config_path.stat().st_size == 0:
            raise BadFileError(self.config_path, "empty (0 bytes)")
        saved: RunConfig = self.config_type.from_yaml(self.config_path)
        return saved

    def start(self, config: RunConfig, resumed: LoopState | None) -> list[str]:
        """Make the folder the run's, once it has loaded: config.yaml (the earlier one kept
        when a resume changed a setting), the folders, metrics.jsonl cut back to the
        checkpoint's step, stale partial saves removed. Returns what to tell the user."""
        notes = []
        start = resumed.step if resumed else 0
        saved = self.saved_config() if config.resume else None
        changed = _changes(saved, config) if saved is not None else []
        if changed:
            kept = self.path / f"config.before_step_{start:06d}.yaml"
            write_text_atomic(kept, self.config_path.read_text())
            notes.append(f"resume: changed {', '.join(changed)}; earlier config: {kept.name}")
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        temporary = temporary_sibling(self.config_path)
        config.to_yaml(temporary)
        replace_file(temporary, self.config_path)
        if config.resume:  # also without a finished checkpoint: then the run starts over
            self.drop_metrics_from(start)
        for path in remove_stale(self.checkpoints_dir) + remove_stale(self.path):
            notes.append(f"resume: removed {path.relative_to(self.path)}, an interrupted save")
        return notes

    # ------------------------------------------------------------ metrics and rollouts

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as file:
            file.write(json.dumps(_finite(record)) + "\n")

    def drop_metrics_from(self, step: int) -> None:
        """On resume: drop the lines of step ``step`` and later, which the checkpoint (after
        ``step`` completed steps) does not contain; the resumed run writes them again. A
        line the kill cut short is dropped too. Atomic: a kill leaves the old file."""
        if not self.metrics_path.exists():
            return
        text = self.metrics_path.read_bytes().decode("utf-8", errors="replace")  # a cut line
        kept = [
            line
            for line in text.splitlines()
            if (line_step := step_of_line(line)) is not None and line_step < step
        ]
        write_text_atomic(self.metrics_path, "".join(line + "\n" for line in kept))

    def dump_rollouts(self, step: int, groups: Sequence[Group], kind: str = "train") -> Path:
        path = self.rollouts_dir / f"{kind}_step_{step:06d}.jsonl"
        with path.open("w") as file:
            for group_index, group in enumerate(groups):
                for episode in group.episodes:
                    record = {"step": step, "group": group_index, **episode_record(episode)}
                    file.write(json.dumps(record, default=str) + "\n")
        return path

    # ------------------------------------------------------------ checkpoints

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:06d}"

    def partial_checkpoint(self, step: int) -> Path:
        """An empty folder for the trainer to write step ``step``'s checkpoint files into."""
        return partial_folder(self.checkpoint_dir(step))

    def commit_checkpoint(self, partial: Path, state: LoopState) -> Path:
        """Add the loop's state and ``complete.json`` to the trainer's files in ``partial``,
        and rename it to its step's folder (replacing one a resumed run saves again)."""
        (partial / LOOP_STATE).write_text(json.dumps(state.__dict__))
        write_manifest(partial)
        sizes = {path.name: path.stat().st_size for path in sorted(partial.iterdir())}
        (partial / COMPLETE).write_text(json.dumps({"files": sizes}, indent=1))
        target = self.checkpoint_dir(state.step)
        commit_folder(partial, target)
        return target

    def checkpoints(self) -> list[Path]:
        """Checkpoint folders (complete or not), newest first."""
        return checkpoint_folders(self.checkpoints_dir)

    def read_checkpoint(self, folder: Path) -> LoopState:
        """The checkpoint's loop state, once its files are all there at the sizes they were
        saved with. ``BadFileError`` names the first file that is not."""
        marker = folder / COMPLETE
        if marker.exists():
            sizes = read_json_object(marker).get("files")
            if not isinstance(sizes, dict):
                raise BadFileError(marker, "has no list of files")
            for name, size in sizes.items():
                path = folder / name
                actual = path.stat().st_size if path.is_file() else None
                if actual != size:
                    found = "missing" if actual is None else f"{actual} bytes"
                    raise BadFileError(path, f"{found}; {size} bytes when it was saved")
            check_manifest(folder)  # written with complete.json: earlier ones have neither
        elif not (folder / LOOP_STATE).exists():
            raise BadFileError(folder / LOOP_STATE, "missing: an interrupted save")
        return _loop_state(folder / LOOP_STATE, folder)


async def resume_from_checkpoint(
    directory: RunDirectory, service: ModelService
) -> tuple[LoopState | None, list[str]]:
    """Load the newest checkpoint that reads back whole into ``service``; the loop state it
    continues from (None: no checkpoint was ever completed, the run starts over), and one
    line per checkpoint skipped, naming the file and what is wrong with it.

    A damaged checkpoint changes nothing in the trainer (it reads every file before it
    applies any), so the next older one is tried. When checkpoints were completed but none
    reads back, this raises instead of starting over: that would overwrite the run's
    metrics, rollouts and, one by one, those checkpoints, which may still be repairable."""
    notes: list[str] = []
    damaged = False
    for folder in directory.checkpoints():
        complete = (folder / COMPLETE).exists() or (folder / LOOP_STATE).exists()
        try:
            state = directory.read_checkpoint(folder)
            await service.load_training_checkpoint(folder)
        except BadFileError as error:  # raised in a Ray actor too: .path, .problem carry over
            damaged |= complete
            notes.append(f"resume: skipped {folder.name}: {_where(error, folder)}")
            continue
        return state, [*notes, f"resume: from {folder.name} (step {state.step})"]
    if damaged:
        raise ValueError(
            f"cannot resume {directory.path}: no checkpoint reads back ("
            + "; ".join(note.removeprefix("resume: skipped ") for note in notes)
            + "); repair one, or move checkpoints/ away to start over"
        )
    return None, [*notes, f"resume: no complete checkpoint in {directory.path}: from step 0"]


def _loop_state(path: Path, folder: Path) -> LoopState:
    data = read_json_object(path)
    kinds = {"step": int, "task_cursor": int, "run_name": str, "done_positions": list}
    for name, kind in kinds.items():
        value = data.get(name, [] if name == "done_positions" else None)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadFileError(path, f"{name} is missing or not a {kind.__name__}")
    state = LoopState(**{name: data[name] for name in kinds if name in data})
    if (
        state.step < 0
        or state.task_cursor < 0
        or not all(isinstance(p, int) for p in state.done_positions)
    ):
        raise BadFileError(path, "holds a negative step or cursor, or a bad done position")
    if folder.name != f"step_{state.step:06d}":
        raise BadFileError(path, f"says step {state.step}, in folder {folder.name}")
    return state


def _where(error: BadFileError, folder: Path) -> str:
    path = Path(error.path)
    shown = path.relative_to(folder) if path.is_relative_to(folder) else path
    return f"{shown}: {error.problem}"


def _must_match(saved: RunConfig, config: RunConfig) -> list[str]:
    lora = saved.use_lora and config.use_lora
    names = [*RESUME_MUST_MATCH, *(RESUME_LORA_MUST_MATCH if lora else ())]
    return [name for name in names if hasattr(saved, name)]  # SFTConfig has no dtype


def _same_value(name: str, saved: Any, now: Any) -> bool:
    if saved == now:
        return True
    if name == "model":  # one local folder, named two ways
        first, second = Path(str(saved)).expanduser(), Path(str(now)).expanduser()
        return first.is_dir() and second.is_dir() and first.samefile(second)
    return False


def _changes(saved: RunConfig, config: RunConfig) -> list[str]:
    """``path old → new`` for every field but ``resume`` that the resumed config changes
    (by its path in the sections, ``optimizer.learning_rate``)."""
    before, after = saved.flat_values(), config.flat_values()
    return [
        f"{path} {old!r} → {after.get(path)!r}"
        for path, old in before.items()
        if path.rpartition(".")[2] != "resume"
        and not _same_value(path.rpartition(".")[2], old, after.get(path))
    ]


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: write them as null."""
    return {
        key: (None if isinstance(value, float) and not math.isfinite(value) else value)
        for key, value in record.items()
    }
