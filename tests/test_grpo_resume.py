"""A run stopped at any moment resumes from its last checkpoint (SPEC §5).

Resuming continues metrics.jsonl from the checkpoint's step with no duplicate lines, the
trainer from the checkpoint's policy version, and the task stream from its cursor, so the
tasks of every step equal those of an uninterrupted run with the same seed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_grpo_common import quick_config, read_jsonl, run_resumable, train_dump

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.train import train_multi_turn

TESTS = Path(__file__).parent


def metric_steps(run_dir: Path) -> list[int]:
    return [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def tasks_per_step(run_dir: Path, num_steps: int) -> list[list[str]]:
    return [
        [record["task"]["prompt"] for record in train_dump(run_dir, step)]
        for step in range(num_steps)
    ]


def versions(run_dir: Path) -> list[float]:
    return [line["policy/version"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def forget_after(run_dir: Path, step: int) -> None:
    """Make ``run_dir`` look like a run killed after writing step ``step``'s metrics line
    but before finishing the checkpoint after it: the later checkpoints are left as a kill
    during their save leaves them (``step_N.partial``, the trainer's files only)."""
    for checkpoint in (run_dir / "checkpoints").iterdir():
        if int(checkpoint.name.removeprefix("step_")) > step:
            (checkpoint / "loop_state.json").unlink()
            (checkpoint / "complete.json").unlink()
            checkpoint.rename(checkpoint.with_name(checkpoint.name + ".partial"))
    shutil.rmtree(run_dir / "final_model")
    kept = [line for line in read_jsonl(run_dir / "metrics.jsonl") if line["step"] <= step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in kept))


def test_resume_after_a_step_whose_checkpoint_was_not_finished_repeats_no_metrics_line(
    tiny_llama_dir, tmp_path
):
    reference = run_resumable(tiny_llama_dir, tmp_path, "reference", num_steps=4)
    run_dir = run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=4, checkpoint_interval=2)
    forget_after(run_dir, 2)  # step 2 was logged; the checkpoint after step 3 was not written
    assert metric_steps(run_dir) == [0, 1, 2]

    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=4, checkpoint_interval=2)
    assert metric_steps(run_dir) == [0, 1, 2, 3]
    assert versions(run_dir) == versions(reference) == [1.0, 2.0, 3.0, 4.0]
    assert tasks_per_step(run_dir, 4) == tasks_per_step(reference, 4)
    assert (run_dir / "final_model" / "config.json").is_file()
    assert not list((run_dir / "checkpoints").glob("*.partial"))  # removed on resume


def test_resume_without_a_finished_checkpoint_starts_over_without_duplicate_lines(
    tiny_llama_dir, tmp_path
):
    run_dir = run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=2, checkpoint_interval=0)
    forget_after(run_dir, 0)  # killed during step 1, before the first checkpoint
    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=2, checkpoint_interval=0)
    assert metric_steps(run_dir) == [0, 1]
    assert versions(run_dir) == [1.0, 2.0]


def test_resume_drops_a_metrics_line_the_kill_cut_short(tiny_llama_dir, tmp_path):
    run_dir = run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=3, checkpoint_interval=2)
    forget_after(run_dir, 1)
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 2, "rollout/rew')  # killed while writing step 2's line
    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=3, checkpoint_interval=2)
    assert metric_steps(run_dir) == [0, 1, 2]


def test_a_run_killed_mid_training_resumes_and_matches_an_uninterrupted_run(
    tiny_llama_dir, tmp_path
):
    num_steps = 8
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, TESTS / "test_grpo_common.py", tiny_llama_dir, tmp_path, str(num_steps)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    second = run_dir / "checkpoints" / "step_000002" / "loop_state.json"
    deadline = time.monotonic() + 240
    while not second.exists():
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert time.monotonic() < deadline, "no second checkpoint within 240 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (run_dir / "final_model").exists(), "the run finished before it was killed"
    killed_at = metric_steps(run_dir)
    assert killed_at[:2] == [0, 1]

    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=num_steps)
    reference = run_resumable(tiny_llama_dir, tmp_path, "reference", num_steps=num_steps)

    assert metric_steps(run_dir) == list(range(num_steps))
    assert tasks_per_step(run_dir, num_steps) == tasks_per_step(reference, num_steps)
    assert versions(run_dir) == versions(reference) == [float(s + 1) for s in range(num_steps)]
    assert (run_dir / "final_model" / "config.json").is_file()


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def engine_threads() -> int:
    return sum(t.name == "LocalEngine" and t.is_alive() for t in threading.enumerate())


def test_a_resume_whose_checkpoint_does_not_fit_fails_and_closes_the_generators(
    tiny_llama_dir, tmp_path
):
    run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=1)
    before = engine_threads()
    with pytest.raises(ValueError, match="use_lora"):
        run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=2, use_lora=False)
    assert engine_threads() == before


def test_two_runs_with_the_same_seed_sample_the_same_episodes(tiny_llama_dir, tmp_path):
    episodes = []
    for name in ("first", "second"):
        config = quick_config(tiny_llama_dir, tmp_path, run_name=name, max_tokens_per_turn=16)
        run = train_multi_turn(config, TOOL_USE_GAME_TASKS[:1], lambda task: ToolUseGameEnv())
        episodes.append([record["token_ids"] for record in train_dump(run.path, 0)])
    assert episodes[0] == episodes[1]
