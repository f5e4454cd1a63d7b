"""What a resume checks in a run folder before it loads anything or changes any file.

- **Checksums.** Every checkpoint carries ``manifest.json``: the sha256 of each of its files,
  written after them and before ``complete.json`` (the commit marker). A resume checks it:
  a file whose bytes changed in place (garbled tensors, NaN bytes, an edited
  ``loop_state.json``) skips that checkpoint naming the file, as a torn one does.
  Checkpoints written before manifests existed resume on their sizes alone.
- **History.** A run that has checkpoints has a ``config.yaml`` and a ``metrics.jsonl``; when
  one is missing, a resume would go on with the run's history gone, so it is refused with
  what to do, unless ``resume_allow_missing_files=True`` says to go on.
- **Plain errors.** A garbled ``metrics.jsonl`` line (not JSON, not an object, a step that is
  not a whole number), a ``metrics.jsonl`` or ``config.yaml`` that is a folder or not text,
  a ``rollouts``/``checkpoints`` that is a file: ``BadFileError`` naming the file (and the
  line), raised before anything in the folder is rewritten. The last line of metrics.jsonl
  may be cut short (a kill while it was written): it is dropped, as before.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from post_training_cookbook.files import BadFileError, read_json_object

MANIFEST = "manifest.json"
"""In a checkpoint: ``{"sha256": {relative path: hex digest}}`` of every other file."""


# ---------------------------------------------------------------- checkpoint manifests


def write_manifest(folder: Path) -> None:
    """The sha256 of every file under ``folder`` (``complete.json`` comes after it)."""
    digests = {relative: sha256_of(folder / relative) for relative in _files_under(folder)}
    (folder / MANIFEST).write_text(json.dumps({"sha256": digests}, indent=1))


def check_manifest(folder: Path) -> None:
    """``BadFileError`` naming the first file whose bytes are not those the manifest lists;
    nothing to check in a checkpoint without one (an earlier version's)."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return
    digests = read_json_object(manifest).get("sha256")
    if not isinstance(digests, dict):
        raise BadFileError(manifest, "has no sha256 list")
    for relative, expected in digests.items():
        path = folder / str(relative)
        if not path.is_file():
            raise BadFileError(path, "missing; the manifest lists it")
        if sha256_of(path) != expected:
            raise BadFileError(path, "changed since it was saved (its sha256 differs)")


def sha256_of(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _files_under(folder: Path) -> list[str]:
    return sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and path.name != MANIFEST
    )


# ---------------------------------------------------------------- the run folder


def check_run_folder(run: Path, *, allow_missing_files: bool) -> None:
    """Raise (``BadFileError``/``ValueError``) when the run folder ``run`` cannot be resumed
    as it is; ``allow_missing_files``: the config's ``resume_allow_missing_files``."""
    config_path, metrics_path = run / "config.yaml", run / "metrics.jsonl"
    for folder in (run / "rollouts", run / "checkpoints"):
        if folder.exists() and not folder.is_dir():
            raise BadFileError(folder, "is a file, not a folder: move it away to resume")
    for file in (config_path, metrics_path):
        if file.exists() and not file.is_file():
            raise BadFileError(file, "is not a file: move it away to resume")
    if metrics_path.exists():
        metric_steps(metrics_path)
    if checkpoint_folders(run / "checkpoints") and not allow_missing_files:
        missing = [path.name for path in (config_path, metrics_path) if not path.exists()]
        if missing:
            raise ValueError(
                f"cannot resume {run}: it has checkpoints but no "
                f"{' or '.join(missing)}, so the run's history "
                f"({'its metrics' if 'metrics.jsonl' in missing else 'its settings'}) is gone; "
                "restore the file from a backup, or set resume_allow_missing_files=True to "
                "go on without it"
            )


def checkpoint_folders(checkpoints_dir: Path) -> list[Path]:
    """The ``step_<N>`` folders in ``checkpoints_dir`` (complete or not), newest first."""
    if not checkpoints_dir.is_dir():
        return []
    steps = {
        int(match.group(1)): folder
        for folder in checkpoints_dir.iterdir()
        if (match := re.fullmatch(r"step_(\d+)", folder.name)) and folder.is_dir()
    }
    return [steps[step] for step in sorted(steps, reverse=True)]


def metric_steps(path: Path) -> list[int | None]:
    """The step of each line of metrics.jsonl (None for a last line cut short), or
    ``BadFileError`` naming the first line that is garbled."""
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    steps: list[int | None] = []
    for number, raw in enumerate(lines, start=1):
        last = number == len(lines)
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            if last:  # a kill while the line was written
                steps.append(None)
                continue
            raise _bad_line(path, number, "not a JSON line") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(record, dict):
            raise _bad_line(path, number, f"a JSON {type(record).__name__}, not an object")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise _bad_line(path, number, f"its step is {step!r}, not a whole number >= 0")
        steps.append(step)
    return steps


def _bad_line(path: Path, number: int, problem: str) -> BadFileError:
    return BadFileError(
        path,
        f"line {number} is {problem}: fix or delete that line (a resume rewrites the lines "
        "from the checkpoint's step on)",
    )


def step_of_line(line: str) -> Any:
    """A metrics line's step, None when it is no metrics line (the loop's own reading)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
