"""Hostile run folders on resume: checkpoint files changed in place (same size) are caught
by their sha256 and the checkpoint skipped naming the file; a lost metrics.jsonl or
config.yaml is refused unless ``resume_allow_missing_files``; garbled metrics lines and
files of the wrong kind are one plain error each, raised before anything in the folder is
rewritten."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from test_grpo_resume_files import (
    NUM_STEPS,
    assert_same_final_model,
    copy_of,
    metric_steps,
    resume,
    snapshot,
)

from post_training_cookbook.files import BadFileError
from post_training_cookbook.grpo.runs import RunDirectory
from post_training_cookbook.runs.checks import MANIFEST


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def finished_run(tiny_llama_dir, tmp_path_factory) -> Path:
    from test_grpo_common import run_resumable

    runs = tmp_path_factory.mktemp("finished")
    return run_resumable(tiny_llama_dir, runs, "run", num_steps=NUM_STEPS, checkpoint_interval=1)


def garble_tail(path: Path) -> None:
    """Flip the last 16 bytes: same size, a header that still describes them."""
    data = bytearray(path.read_bytes())
    data[-16:] = bytes(b ^ 0x5A for b in data[-16:])
    path.write_bytes(bytes(data))


def nan_tail(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64  # float32 NaN, bit for bit
    path.write_bytes(bytes(data))


def other_cursor(path: Path) -> None:
    state = json.loads(path.read_text())
    text = path.read_text()
    changed = text.replace(f'"task_cursor": {state["task_cursor"]}', '"task_cursor": 0')
    assert changed != text
    path.write_text(changed)


IN_PLACE: dict[str, tuple[str, Callable[[Path], None]]] = {
    "garbled weights": ("trainable.safetensors", garble_tail),
    "NaN optimizer": ("optimizer.safetensors", nan_tail),
    "garbled rng": ("rng.safetensors", garble_tail),
    "another cursor": ("loop_state.json", other_cursor),
}


def test_every_checkpoint_carries_a_sha256_manifest_before_its_commit_marker(finished_run):
    for folder in (finished_run / "checkpoints").iterdir():
        listed = json.loads((folder / MANIFEST).read_text())["sha256"]
        files = {p.name for p in folder.iterdir()} - {MANIFEST, "complete.json"}
        assert set(listed) == files
        assert MANIFEST in json.loads((folder / "complete.json").read_text())["files"]


@pytest.mark.parametrize("damage", IN_PLACE)
def test_a_file_changed_in_place_skips_its_checkpoint_naming_it(finished_run, tmp_path, damage):
    run_dir = copy_of(finished_run, tmp_path)
    name, change = IN_PLACE[damage]
    folder = run_dir / "checkpoints" / "step_000003"
    size = (folder / name).stat().st_size
    change(folder / name)
    if damage != "another cursor":
        assert (folder / name).stat().st_size == size
    with pytest.raises(BadFileError, match=f"{name}: changed since it was saved"):
        RunDirectory(run_dir).read_checkpoint(folder)
    RunDirectory(run_dir).read_checkpoint(run_dir / "checkpoints" / "step_000002")


def test_a_resume_past_a_garbled_rng_file_trains_on_from_the_checkpoint_before(
    tiny_llama_dir, finished_run, tmp_path, capsys
):
    run_dir = copy_of(finished_run, tmp_path)
    garble_tail(run_dir / "checkpoints" / "step_000003" / "rng.safetensors")
    capsys.readouterr()
    resume(tiny_llama_dir, tmp_path)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]
    assert notes[0] == (
        "resume: skipped step_000003: rng.safetensors: changed since it was saved "
        "(its sha256 differs)"
    )
    assert notes[1] == "resume: from step_000002 (step 2)"
    assert metric_steps(run_dir) == list(range(NUM_STEPS))
    assert_same_final_model(run_dir, finished_run)


@pytest.mark.parametrize("lost", ["metrics.jsonl", "config.yaml"])
def test_a_lost_history_file_is_refused_unless_the_user_says_go_on(
    tiny_llama_dir, finished_run, tmp_path, lost
):
    run_dir = copy_of(finished_run, tmp_path)
    (run_dir / lost).unlink()
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=rf"no {lost}.*resume_allow_missing_files=True"):
        resume(tiny_llama_dir, tmp_path)
    assert snapshot(run_dir) == before

    from test_grpo_common import run_resumable

    run_resumable(
        tiny_llama_dir, tmp_path, "run", resume=True, num_steps=NUM_STEPS,
        checkpoint_interval=1, resume_allow_missing_files=True,
    )  # fmt: skip
    assert (run_dir / "final_model").is_dir()  # resumed from step 3 and finished


GARBLED_LINES = {
    "null step": b'{"step": null}',
    "float step": b'{"step": 2.5}',
    "huge step": b'{"step": 1e999}',
    "not json": b"step one",
    "not utf-8": b'{"step": 1, "x": "\xff\xfe"}',
    "a list": b"[1, 2]",
    "negative step": b'{"step": -3}',
}


@pytest.mark.parametrize("garbled", GARBLED_LINES)
def test_a_garbled_metrics_line_is_a_plain_error_before_anything_changes(
    tiny_llama_dir, finished_run, tmp_path, garbled
):
    run_dir = copy_of(finished_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines()
    metrics.write_bytes(b"\n".join([lines[0], GARBLED_LINES[garbled], *lines[1:]]) + b"\n")
    before = snapshot(run_dir)
    with pytest.raises(BadFileError, match=r"metrics.jsonl: line 2 is"):
        resume(tiny_llama_dir, tmp_path)
    assert snapshot(run_dir) == before


def test_a_last_metrics_line_cut_short_is_still_dropped_quietly(
    tiny_llama_dir, finished_run, tmp_path
):
    run_dir = copy_of(finished_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + '{"step": 3, "é'.encode()[:-1])
    resume(tiny_llama_dir, tmp_path)
    assert metric_steps(run_dir) == list(range(NUM_STEPS))


def make_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def make_binary(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary")


def make_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_text("not a folder")


WRONG_KIND: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "metrics.jsonl a folder": ("metrics.jsonl", make_folder, "is not a file"),
    "config.yaml binary": ("config.yaml", make_binary, "not text"),
    "config.yaml a folder": ("config.yaml", make_folder, "is not a file"),
    "rollouts a file": ("rollouts", make_file, "is a file, not a folder"),
}


@pytest.mark.parametrize("case", WRONG_KIND)
def test_files_of_the_wrong_kind_are_a_plain_error_before_anything_changes(
    tiny_llama_dir, finished_run, tmp_path, case
):
    run_dir = copy_of(finished_run, tmp_path)
    name, change, words = WRONG_KIND[case]
    change(run_dir / name)
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=words):
        resume(tiny_llama_dir, tmp_path)
    assert snapshot(run_dir) == before
