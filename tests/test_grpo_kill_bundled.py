"""A GRPO run of the bundled model killed with SIGKILL in the middle of a step resumes and
trains on exactly the episodes of an uninterrupted run: none lost, none repeated.

The other kill tests (``test_grpo_resume.py``, ``test_grpo_resume_files.py``) script the
policy's replies; here the bundled model samples for real, with dynamic sampling, so the
episodes a step trains on depend on the weights the resumed run restored, the sampling seeds
of each task position and the task stream's cursor. Every run is a subprocess of this file
(the same threads and settings), so the uninterrupted one is comparable token for token.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_grpo_common import read_jsonl, train_dump

from post_training_cookbook.envs import Task
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.types import Message

NUM_STEPS = 5
KILL_IN_STEP = 2
"""Killed once step 2's checkpoint-before is written and step 2 has started sampling."""
COMPARED_STEPS = KILL_IN_STEP + 1
"""Steps compared token for token with the uninterrupted run: those before the kill and the
killed step, sampled again from the restored weights and seeds. Later steps may part without
anything lost or repeated: the engine's log-probabilities of the same tokens depend on which
rows it decoded together (timing), so two runs' updates of the same episodes differ (~1e-4
in the loss), and from the next step on a sampled token can flip (on an AVX-512 CPU, 3 of 6
runs of this test parted at step 4 and 1 of 7 at step 3 or 4, on the same commit)."""


class CountedResets(ToolUseGameEnv):
    """The tool-use game, appending a line to ``$RESETS`` at every episode's start: how the
    test tells that a step's sampling is under way."""

    async def reset(self, task: Task) -> list[Message]:
        with open(os.environ["RESETS"], "a") as resets:
            resets.write("reset\n")
        return await super().reset(task)


def run(runs_dir: Path, name: str, resume: bool) -> None:
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,
        runs_dir=str(runs_dir),
        run_name=name,
        resume=resume,
        wandb_project=None,
        batch_size=2,
        episodes_per_task=4,
        num_steps=NUM_STEPS,
        max_turns=4,
        max_model_length=1024,
        learning_rate=2e-4,
        use_lora=False,
        validation_interval=0,
        checkpoint_interval=1,
        max_sampling_attempts=2,
        seed=7,
    )
    train_multi_turn(config, list(TOOL_USE_GAME_TRAIN_TASKS), lambda task: CountedResets())


def start(runs_dir: Path, name: str, resume: bool, resets: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, str(runs_dir), name, "resume" if resume else "new"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "RESETS": str(resets)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen) -> None:
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr.decode()


def resets(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def episodes_per_step(run_dir: Path) -> list[list[list[int]]]:
    return [[r["token_ids"] for r in train_dump(run_dir, step)] for step in range(NUM_STEPS)]


def test_a_run_killed_mid_step_resumes_with_no_episode_lost_or_repeated(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "resets_run"
    process = start(tmp_path, "run", False, marker)
    checkpoint = run_dir / "checkpoints" / f"step_{KILL_IN_STEP:06d}" / "complete.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists():
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert time.monotonic() < deadline, f"no {checkpoint.parent.name} within 300 s"
        time.sleep(0.01)
    started = resets(marker)
    while resets(marker) == started:  # step 2's first episode has begun
        assert process.poll() is None, "the run ended before step 2 sampled"
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    steps = [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(KILL_IN_STEP)), "killed after step 2 finished, not in it"

    finish(start(tmp_path, "run", True, marker))
    finish(start(tmp_path, "reference", False, tmp_path / "resets_reference"))

    reference = tmp_path / "reference"
    assert [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")] == list(
        range(NUM_STEPS)
    )
    resumed = episodes_per_step(run_dir)[:COMPARED_STEPS]
    uninterrupted = episodes_per_step(reference)[:COMPARED_STEPS]
    # the same episodes, token for token, step by step: the killed step sampled again from
    # the restored weights and seeds, nothing of it kept, nothing of the steps before redone
    assert resumed == uninterrupted
    assert all(len(step) >= 4 for step in episodes_per_step(run_dir))  # a group a step, or more
    # and each compared step took the uninterrupted run's optimizer step. Two runs of the same
    # episodes differ a little: on an AVX-512 CPU the near-zero loss (~1e-4) moved by up to
    # 4e-5 and the gradient norm by 0.2% (likely the sampler's log-probabilities of the same
    # tokens, which depend on which rows the engine decoded together, i.e. on timing); a lost
    # or repeated step trains on other episodes and moves the gradient norm by far more
    for key, tolerance in (("loss/loss", {"abs": 1.5e-4}), ("optim/grad_norm", {"rel": 1e-2})):
        compared = [read_jsonl(d / "metrics.jsonl")[:COMPARED_STEPS] for d in (run_dir, reference)]
        assert [line[key] for line in compared[0]] == pytest.approx(
            [line[key] for line in compared[1]], **tolerance
        )


if __name__ == "__main__":
    # this test's subprocess: python test_grpo_kill_bundled.py RUNS_DIR NAME new|resume
    run(Path(sys.argv[1]), sys.argv[2], resume=sys.argv[3] == "resume")
