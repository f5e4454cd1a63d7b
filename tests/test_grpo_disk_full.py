"""A disk that fills up while a checkpoint or the final model is written (issue 58, item 4).

The save fails partway through the checkpoint's files, the way a full disk fails it: the
files before are whole, the one being written is cut short, and the writer raises (an
``OSError`` ENOSPC from Python's own writes; safetensors' Rust writer raises its own
``SafetensorError`` with the OS's message). The run stops with ``DiskFullError`` naming the
folder and the space left; the checkpoint before stays intact and loadable, the unfinished
one is not taken for a checkpoint, and a resume continues from the one before with every
step in metrics.jsonl once, ending as an uninterrupted run ends.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers.modeling_utils
from safetensors import SafetensorError
from test_grpo_common import assert_same_final_model, read_jsonl, run_resumable, train_dump

from post_training_cookbook.grpo.runs import RunDirectory
from post_training_cookbook.runs.directory import LoopState
from post_training_cookbook.runs.saving import DiskFullError, is_disk_full
from post_training_cookbook.trainer import checkpoints

NUM_STEPS = 3
SAFETENSORS_DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
"""What safetensors 0.8's ``save_file`` raised on a 64 kB tmpfs that filled up."""


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory) -> Path:
    """An uninterrupted run: what each resumed run must end as."""
    runs = tmp_path_factory.mktemp("reference")
    return run_resumable(tiny_llama_dir, runs, "run", num_steps=NUM_STEPS)


def metric_steps(run_dir: Path) -> list[int]:
    return [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def outcome(run_dir: Path) -> tuple[list[list[str]], list[float]]:
    """The tasks of every step, and the policy version after each."""
    tasks = [[r["task"]["prompt"] for r in train_dump(run_dir, s)] for s in range(NUM_STEPS)]
    return tasks, [line["policy/version"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


# ---------------------------------------------------------------- the full disk


def os_error(path: Path) -> Exception:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # Python's writes name no file


def safetensors_error(path: Path) -> Exception:
    return SafetensorError(SAFETENSORS_DISK_FULL)


def cut_short(path: Path) -> None:
    """What reached the disk of a file being written when it filled up."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def fill_at_second_trainer_file(
    patch: pytest.MonkeyPatch, folder: str, error: Callable[[Path], Exception]
) -> None:
    """The disk fills while the second safetensors file of the checkpoint ``folder`` is
    written (the optimizer's: the weights before it are whole)."""
    save_file, written = checkpoints.save_file, []

    def save_file_on_a_filling_disk(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> None:
        save_file(tensors, filename, *args, **kwargs)
        path = Path(filename)
        if path.parent.name == folder:
            written.append(path.name)
            if len(written) == 2:
                cut_short(path)
                raise error(path)

    patch.setattr(checkpoints, "save_file", save_file_on_a_filling_disk)


def fill_at_complete_json(patch: pytest.MonkeyPatch, folder: str) -> None:
    """The disk fills while ``complete.json``, the checkpoint's last file, is written."""
    write_text = Path.write_text

    def write_text_on_a_filling_disk(path: Path, text: str, *args: Any, **kwargs: Any) -> int:
        written = write_text(path, text, *args, **kwargs)
        if path.name == "complete.json" and path.parent.name == folder:
            cut_short(path)
            raise os_error(path)
        return written

    patch.setattr(Path, "write_text", write_text_on_a_filling_disk)


FAULTS: dict[str, Callable[[pytest.MonkeyPatch, str], None]] = {
    "optimizer file, OSError": lambda p, f: fill_at_second_trainer_file(p, f, os_error),
    "optimizer file, SafetensorError": lambda p, f: fill_at_second_trainer_file(
        p, f, safetensors_error
    ),
    "complete.json, OSError": fill_at_complete_json,
}


def disk_full_message(target: Path, what_is_kept: str) -> str:
    """``DiskFullError``'s message as a pattern (the space left is the machine's)."""
    return (
        rf"no space left on device while writing {re.escape(str(target))} "
        r"\([\d.]+ ([kMG]B|bytes) free there now\); its unfinished save was removed, "
        rf"{re.escape(what_is_kept)}\. Free space, then run again with resume=True"
    )


@pytest.mark.parametrize("fault", FAULTS)
def test_a_full_disk_during_a_checkpoint_stops_by_name_and_the_run_resumes_from_the_one_before(
    tiny_llama_dir, reference, tmp_path, capsys, fault
):
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        FAULTS[fault](patch, "step_000002.partial")
        with pytest.raises(DiskFullError) as full:
            run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=NUM_STEPS)
    kept = "the checkpoints saved before it are untouched (the newest: step_000001)"
    target = run_dir / "checkpoints" / "step_000002"
    assert re.fullmatch(disk_full_message(target, kept), str(full.value)), str(full.value)
    assert full.value.errno == errno.ENOSPC and isinstance(full.value, OSError)
    assert is_disk_full(full.value.__cause__)  # the writer's own error, kept
    # The checkpoint before reads back whole; nothing of the unfinished one is left to be
    # taken for a checkpoint; step 1's metrics line is the checkpoint's to drop.
    assert checkpoint_names(run_dir) == ["step_000001"]
    assert RunDirectory(run_dir).read_checkpoint(run_dir / "checkpoints" / "step_000001") == (
        LoopState(step=1, task_cursor=2, run_name="run")
    )
    assert metric_steps(run_dir) == [0, 1]
    assert not (run_dir / "final_model").exists()
    capsys.readouterr()

    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=NUM_STEPS)

    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]
    assert notes == ["resume: from step_000001 (step 1)"]
    assert metric_steps(run_dir) == list(range(NUM_STEPS))
    assert outcome(run_dir) == outcome(reference)
    assert_same_final_model(run_dir, reference)
    assert checkpoint_names(run_dir) == ["step_000001", "step_000002", "step_000003"]


def test_a_full_disk_during_the_final_model_stops_by_name_and_a_resume_writes_it(
    tiny_llama_dir, reference, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    safe_save_file = transformers.modeling_utils.safe_save_file

    def save_on_a_full_disk(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> None:
        safe_save_file(tensors, filename, *args, **kwargs)
        cut_short(Path(filename))
        raise safetensors_error(Path(filename))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "safe_save_file", save_on_a_full_disk)
        with pytest.raises(DiskFullError) as full:
            run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=NUM_STEPS)
    kept = "every checkpoint is untouched, and a resume from the last writes the final model"
    message = disk_full_message(run_dir / "final_model", kept)
    assert re.fullmatch(message, str(full.value)), str(full.value)
    assert sorted(path.name for path in run_dir.iterdir() if "final_model" in path.name) == []
    assert checkpoint_names(run_dir) == ["step_000001", "step_000002", "step_000003"]
    capsys.readouterr()

    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=NUM_STEPS)

    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]
    assert notes == ["resume: from step_000003 (step 3)"]
    assert metric_steps(run_dir) == list(range(NUM_STEPS))
    assert_same_final_model(run_dir, reference)


# ---------------------------------------------------------------- recognising a full disk


@pytest.mark.parametrize(
    ("error", "full"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (SafetensorError(SAFETENSORS_DISK_FULL), True),
        (OSError(errno.EACCES, "Permission denied"), False),
        (
            SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)"),
            False,
        ),
        (ValueError("step 28 has no line"), False),
    ],
    ids=["ENOSPC", "EDQUOT", "safetensors", "EACCES", "safetensors EACCES", "other"],
)
def test_a_full_disk_is_told_from_other_write_errors_as_each_writer_reports_it(error, full):
    assert is_disk_full(error) is full
    try:  # as a Ray actor's error, or any wrapper that keeps its cause, carries it
        raise RuntimeError("the trainer's save failed") from error
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped) is full
