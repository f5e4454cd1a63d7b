"""Resume survives damaged and interrupted files (issue 17, findings 6 and 7).

- A damaged newest checkpoint (each way finding 6 lists) is skipped, named with the file and
  what is wrong with it, and the run resumes from the one before, ending as an uninterrupted
  run ends; checkpoints written before ``complete.json`` existed resume the same way.
- A start or resume that fails leaves the run folder as it was.
- kill -9 inside a checkpoint's save (deterministically: the subprocess waits there to be
  killed) and at random moments (``heavy``): every step is in metrics.jsonl exactly once,
  the final model loads, and its weights equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_grpo_common import (
    assert_same_final_model,
    output_of,
    read_jsonl,
    run_resumable,
    start_run,
    train_dump,
)


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def metric_steps(run_dir: Path) -> list[int]:
    return [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def outcome(run_dir: Path, num_steps: int) -> tuple[list[list[str]], list[float]]:
    """What a resumed run must share with an uninterrupted one: the tasks of every step, and
    the policy version after each."""
    tasks = [[r["task"]["prompt"] for r in train_dump(run_dir, s)] for s in range(num_steps)]
    return tasks, [line["policy/version"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


# ---------------------------------------------------------------- damaged newest checkpoints


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def emptied(path: Path) -> None:
    path.write_bytes(b"")


# Each damage finding 6 lists: (the file, the damage, what a checkpoint without
# complete.json says about it). With complete.json, every one is a file of the wrong size.
DAMAGE: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "truncated weights": ("trainable.safetensors", cut_in_half, "cut short: "),
    "truncated optimizer": ("optimizer.safetensors", cut_in_half, "cut short: "),
    "truncated rng": ("rng.safetensors", cut_in_half, "cut short: "),
    "empty loop_state.json": ("loop_state.json", emptied, "empty (0 bytes)"),
    "cut loop_state.json": ("loop_state.json", cut_in_half, "not valid JSON"),
    "empty trainer_state.json": ("trainer_state.json", emptied, "empty (0 bytes)"),
    "cut trainer_state.json": ("trainer_state.json", cut_in_half, "not valid JSON"),
}
NUM_STEPS = 3


@pytest.fixture(scope="module")
def finished_run(tiny_llama_dir, tmp_path_factory) -> Path:
    """An uninterrupted run with a checkpoint after every step: copied, damaged and resumed
    by the tests, and the outcome they must reach."""
    runs = tmp_path_factory.mktemp("finished")
    return run_resumable(tiny_llama_dir, runs, "run", num_steps=NUM_STEPS, checkpoint_interval=1)


def copy_of(run_dir: Path, runs_dir: Path, *, earlier_version: bool = False) -> Path:
    """A copy of ``run_dir`` in ``runs_dir`` whose final model is gone, as if killed just
    before writing it. ``earlier_version``: its checkpoints lose ``complete.json``, as those
    written before it existed."""
    copy = shutil.copytree(run_dir, runs_dir / "run")
    shutil.rmtree(copy / "final_model")
    if earlier_version:
        for marker in (copy / "checkpoints").glob("*/complete.json"):
            marker.unlink()
    return copy


def resume(tiny_llama_dir: Path, runs_dir: Path) -> Path:
    return run_resumable(
        tiny_llama_dir, runs_dir, "run", resume=True, num_steps=NUM_STEPS, checkpoint_interval=1
    )


@pytest.mark.parametrize("earlier_version", [False, True], ids=["complete.json", "without"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_with_its_reason_and_the_one_before_resumes(
    tiny_llama_dir, finished_run, tmp_path, capsys, damage, earlier_version
):
    run_dir = copy_of(finished_run, tmp_path, earlier_version=earlier_version)
    name, damage_file, problem = DAMAGE[damage]
    damaged = run_dir / "checkpoints" / "step_000003" / name
    size = damaged.stat().st_size
    damage_file(damaged)
    if not earlier_version:  # complete.json's sizes tell first
        problem = f"{damaged.stat().st_size} bytes; {size} bytes when it was saved"
    capsys.readouterr()

    resume(tiny_llama_dir, tmp_path)

    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]
    assert notes[0].startswith(f"resume: skipped step_000003: {name}: {problem}"), notes
    assert notes[1] == "resume: from step_000002 (step 2)"
    assert metric_steps(run_dir) == list(range(NUM_STEPS))
    assert outcome(run_dir, NUM_STEPS) == outcome(finished_run, NUM_STEPS)
    assert_same_final_model(run_dir, finished_run)
    assert checkpoint_names(run_dir) == ["step_000001", "step_000002", "step_000003"]
    assert damaged.stat().st_size == size  # saved again, whole


@pytest.mark.parametrize("unfinished", ["newest", "all"])
def test_checkpoints_an_earlier_version_left_unfinished_are_skipped(
    tiny_llama_dir, finished_run, tmp_path, capsys, unfinished
):
    """Before complete.json, a folder without loop_state.json was an interrupted save: not
    damage. With none finished, the run starts over, as it always did."""
    run_dir = copy_of(finished_run, tmp_path, earlier_version=True)
    folders = sorted((run_dir / "checkpoints").iterdir())
    for folder in folders if unfinished == "all" else folders[-1:]:
        (folder / "loop_state.json").unlink()
    capsys.readouterr()
    resume(tiny_llama_dir, tmp_path)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]
    skipped = "loop_state.json: missing: an interrupted save"
    if unfinished == "newest":
        assert notes[:2] == [
            f"resume: skipped step_000003: {skipped}",
            "resume: from step_000002 (step 2)",
        ]
    else:
        assert notes[3] == f"resume: no complete checkpoint in {run_dir}: from step 0"
    assert metric_steps(run_dir) == list(range(NUM_STEPS))
    assert outcome(run_dir, NUM_STEPS) == outcome(finished_run, NUM_STEPS)
    assert_same_final_model(run_dir, finished_run)


def test_a_resume_with_no_readable_checkpoint_fails_and_changes_nothing(
    tiny_llama_dir, finished_run, tmp_path
):
    run_dir = copy_of(finished_run, tmp_path)
    for checkpoint in (run_dir / "checkpoints").iterdir():
        cut_in_half(checkpoint / "trainable.safetensors")
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=r"no checkpoint reads back \(step_000003: trainable"):
        resume(tiny_llama_dir, tmp_path)
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------- a failed start or resume


def test_a_resume_with_another_lora_rank_fails_before_loading_and_changes_nothing(
    tiny_llama_dir, finished_run, tmp_path
):
    run_dir = copy_of(finished_run, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=r"lora_rank=16 in the run, 8 now"):
        run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=4, lora_rank=8)
    assert snapshot(run_dir) == before


def test_a_start_that_fails_while_loading_leaves_no_run_folder_to_block_a_rerun(
    tiny_llama_dir, tmp_path
):
    with pytest.raises(ValueError, match="unknown codec 'hermes2'"):
        run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=1, codec="hermes2")
    assert not (tmp_path / "run").exists()
    run_dir = run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=1)
    assert metric_steps(run_dir) == [0]


def test_a_resume_that_changes_settings_keeps_the_runs_earlier_config(
    tiny_llama_dir, finished_run, tmp_path, capsys
):
    run_dir = copy_of(finished_run, tmp_path)
    earlier = (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=4, checkpoint_interval=1)
    assert "resume: changed optimizer.num_steps 3 → 4, checkpoints.runs_dir " in (
        capsys.readouterr().out
    )
    assert (run_dir / "config.before_step_000003.yaml").read_text() == earlier
    assert "num_steps: 4" in (run_dir / "config.yaml").read_text()
    assert metric_steps(run_dir) == [0, 1, 2, 3]


OLD_FLAT_CONFIG = Path(__file__).parent / "data" / "flat_config_before_sections.yaml"


def test_a_run_saved_with_a_flat_config_yaml_before_the_sections_still_resumes(
    tiny_llama_dir, finished_run, tmp_path, capsys
):
    """config.yaml as main wrote it before the sections (every field flat): the resume
    loads it with a warning naming the new keys, compares the fields that must match, and
    writes the config back nested."""
    run_dir = copy_of(finished_run, tmp_path)
    flat = OLD_FLAT_CONFIG.read_text()
    flat = flat.replace("MODEL_DIR", str(tiny_llama_dir)).replace("RUNS_DIR", str(tmp_path))
    (run_dir / "config.yaml").write_text(flat)
    capsys.readouterr()
    with pytest.warns(DeprecationWarning, match="`lora_rank` is now `optimizer.lora_rank`"):
        run_resumable(
            tiny_llama_dir, tmp_path, "run", resume=True, num_steps=4, checkpoint_interval=1
        )
    assert "resume: changed optimizer.num_steps 3 → 4" in capsys.readouterr().out
    assert (run_dir / "config.before_step_000003.yaml").read_text() == flat
    saved = (run_dir / "config.yaml").read_text()
    assert "optimizer:\n" in saved and "\nlora_rank:" not in saved
    assert metric_steps(run_dir) == [0, 1, 2, 3]
    other = tmp_path / "other"
    flat_other = OLD_FLAT_CONFIG.read_text().replace("MODEL_DIR", str(tiny_llama_dir))
    (copy_of(finished_run, other) / "config.yaml").write_text(
        flat_other.replace("RUNS_DIR", str(other))
    )
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="lora_rank=16 in the"):
        run_resumable(tiny_llama_dir, other, "run", resume=True, num_steps=4, lora_rank=8)


# ---------------------------------------------------------------- kill -9


def kill_when_paused(process: subprocess.Popen, flag: Path) -> None:
    """SIGKILL ``process`` once it waits inside a checkpoint's save (see
    ``test_grpo_common.pause_in_checkpoint``)."""
    deadline = time.monotonic() + 240
    while not flag.exists():
        assert process.poll() is None, output_of(flag.parent)
        assert time.monotonic() < deadline, "the run did not reach the pause within 240 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    flag.unlink()


def test_kills_inside_checkpoint_saves_lose_and_repeat_no_step(tiny_llama_dir, tmp_path, capsys):
    num_steps, flag = 6, tmp_path / "paused"
    run_dir = tmp_path / "run"
    # Killed once step 3's trainer files are written, before its loop state.
    run = start_run(tiny_llama_dir, tmp_path, num_steps, resume=False,
                    PAUSE_IN_CHECKPOINT="files:3", PAUSE_FLAG=str(flag))  # fmt: skip
    kill_when_paused(run, flag)
    assert checkpoint_names(run_dir) == ["step_000001", "step_000002", "step_000003.partial"]
    assert metric_steps(run_dir) == [0, 1, 2]
    # Step 2's checkpoint damaged by hand: the resume goes back to step 1 and saves step 2
    # again; killed between setting the damaged one aside and renaming the new one in.
    cut_in_half(run_dir / "checkpoints" / "step_000002" / "optimizer.safetensors")
    run = start_run(tiny_llama_dir, tmp_path, num_steps, resume=True,
                    PAUSE_IN_CHECKPOINT="rename:2", PAUSE_FLAG=str(flag))  # fmt: skip
    kill_when_paused(run, flag)
    assert checkpoint_names(run_dir) == [
        "step_000001",
        "step_000002.partial",
        "step_000002.replaced",
    ]
    capsys.readouterr()

    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=num_steps)

    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]
    assert notes == [
        "resume: from step_000001 (step 1)",
        "resume: removed checkpoints/step_000002.partial, an interrupted save",
        "resume: removed checkpoints/step_000002.replaced, an interrupted save",
    ]
    reference = run_resumable(tiny_llama_dir, tmp_path, "reference", num_steps=num_steps)
    assert metric_steps(run_dir) == list(range(num_steps))
    assert outcome(run_dir, num_steps) == outcome(reference, num_steps)
    assert_same_final_model(run_dir, reference)
    assert checkpoint_names(run_dir) == [f"step_{step:06d}" for step in range(1, num_steps + 1)]


def timed_training(model: Path, runs_dir: Path, num_steps: int, **env: str) -> float:
    """Run ``start_run`` uninterrupted; return the seconds from its config.yaml being written
    (the model has loaded) to its last checkpoint being committed."""
    runs_dir.mkdir()
    run_dir, run = runs_dir / "run", start_run(model, runs_dir, num_steps, resume=False, **env)
    last_checkpoint = run_dir / "checkpoints" / f"step_{num_steps:06d}"
    loaded = None
    while not last_checkpoint.exists():
        assert run.poll() is None, output_of(runs_dir)
        if loaded is None and (run_dir / "config.yaml").exists():
            loaded = time.monotonic()
        time.sleep(0.005)
    assert loaded is not None
    seconds = time.monotonic() - loaded
    assert run.wait() == 0, output_of(runs_dir)
    return seconds


@pytest.mark.heavy
def test_kills_at_random_moments_lose_and_repeat_no_step(tiny_llama_dir, tmp_path):
    """Seeded random SIGKILLs, during loading too, then a resume that runs to the end;
    checkpoint writes are slowed so that many kills land inside one. The moments are drawn
    within the time an uninterrupted run of the same machine takes to train, so that kills
    land in training however fast the machine is (a fixed window let process start-up and
    exit eat every attempt on a slow machine)."""
    rng, num_steps, run_dir = random.Random(17), 10, tmp_path / "run"
    slow = {"SLOW_CHECKPOINT_S": "0.05"}
    training_s = timed_training(tiny_llama_dir, tmp_path / "reference", num_steps, **slow)
    kills, inside_checkpoints, attempts = 0, 0, 12
    for attempt in range(attempts):
        config = run_dir / "config.yaml"
        written_before = config.stat().st_mtime_ns if config.exists() else 0
        run = start_run(tiny_llama_dir, tmp_path, num_steps, resume=attempt > 0, **slow)
        if rng.random() < 0.25:  # anywhere, loading included
            delay = rng.uniform(0.0, 8.0)
        else:  # while it trains: once config.yaml is (re)written, the run has loaded
            deadline = time.monotonic() + 240
            while run.poll() is None and (not config.exists() or
                                          config.stat().st_mtime_ns == written_before):  # fmt: skip
                assert time.monotonic() < deadline
                time.sleep(0.01)
            delay = rng.uniform(0.0, training_s)
        try:
            run.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            run.send_signal(signal.SIGKILL)
            run.wait()
            kills += 1
            inside_checkpoints += any((run_dir / "checkpoints").glob("*.partial"))
            continue
        # Finished before its kill: the next attempts resume a finished run (and may kill
        # it while it writes its final model again).
        assert run.returncode == 0, output_of(tmp_path)
    assert kills >= attempts // 2, kills
    final = start_run(tiny_llama_dir, tmp_path, num_steps, resume=True)
    assert final.wait() == 0, output_of(tmp_path)
    reference = tmp_path / "reference" / "run"
    assert metric_steps(run_dir) == list(range(num_steps)), (kills, inside_checkpoints)
    assert outcome(run_dir, num_steps) == outcome(reference, num_steps)
    assert_same_final_model(run_dir, reference)
    assert checkpoint_names(run_dir) == [f"step_{step:06d}" for step in range(1, num_steps + 1)]
    print(json.dumps({"kills": kills, "inside_checkpoints": inside_checkpoints}))
