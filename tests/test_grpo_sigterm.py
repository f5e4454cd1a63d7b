"""A scheduler's SIGTERM during a GRPO run (issue 58, item 4): the run finishes the step it
is in, saves a checkpoint of that step (none was due on schedule), closes its generators
and engines, and raises ``TrainingStopped`` naming the step and the checkpoint. Resumed,
it continues exactly there: every step in metrics.jsonl once, every step's tasks and the
final weights those of an uninterrupted run.

The subprocess test sends a real SIGTERM from outside, at a moment read from the run's
files. The in-process tests raise it inside a chosen step (during its optimizer step), so
that which step the run stops after is known; the test's own handler stands behind the
run's, and must get nothing while the run holds SIGTERM and be back afterwards.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_grpo_common import (
    LIVE,
    Closes,
    ScriptedPolicy,
    assert_same_final_model,
    mode_envs,
    mode_tasks,
    output_of,
    quick_config,
    read_jsonl,
    run_resumable,
    start_run,
    train_dump,
)

from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.runs.directory import RunDirectory
from post_training_cookbook.runs.stopping import TrainingStopped
from post_training_cookbook.service import LocalModelService


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def sigterm_during_optimizer_step(monkeypatch: Any, step: int) -> None:
    """SIGTERM to this process inside the optimizer step of step ``step`` (0-based)."""
    optim_step, calls = LocalModelService.optim_step, []

    async def optim_step_then_sigterm(service: LocalModelService, learning_rate: float) -> Any:
        calls.append(learning_rate)
        if len(calls) == step + 1:
            signal.raise_signal(signal.SIGTERM)
        return await optim_step(service, learning_rate)

    monkeypatch.setattr(LocalModelService, "optim_step", optim_step_then_sigterm)


def metric_steps(run_dir: Path) -> list[int]:
    return [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


def outcome(run_dir: Path, num_steps: int) -> tuple[list[list[str]], list[float]]:
    """The tasks of every step, and the policy version after each."""
    tasks = [[r["task"]["prompt"] for r in train_dump(run_dir, s)] for s in range(num_steps)]
    return tasks, [line["policy/version"] for line in read_jsonl(run_dir / "metrics.jsonl")]


def engine_threads() -> int:
    return sum(t.name == "LocalEngine" and t.is_alive() for t in threading.enumerate())


def test_a_sigterm_from_outside_stops_after_the_step_saved_and_the_resume_continues_there(
    tiny_llama_dir, tmp_path
):
    num_steps, run_dir = 8, tmp_path / "run"
    # Only the final checkpoint is due: any other is the stop's.
    run = start_run(tiny_llama_dir, tmp_path, num_steps, resume=False, CHECKPOINT_INTERVAL="0")
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert run.poll() is None, output_of(tmp_path)
        assert time.monotonic() < deadline, "no second step within 240 s"
        time.sleep(0.01)
    run.send_signal(signal.SIGTERM)  # during step 2, or between steps 1 and 2
    assert run.wait(timeout=120) == 1, output_of(tmp_path)  # the uncaught TrainingStopped

    (stopped_after,) = [int(name.removeprefix("step_")) for name in checkpoint_names(run_dir)]
    assert 2 <= stopped_after < num_steps
    checkpoint = run_dir / "checkpoints" / f"step_{stopped_after:06d}"
    assert (
        f"TrainingStopped: stopped by SIGTERM after {stopped_after} steps (checkpoint "
        f"{checkpoint}); resume with resume=True to continue"
    ) in output_of(tmp_path)
    assert RunDirectory(run_dir).read_checkpoint(checkpoint).step == stopped_after
    assert metric_steps(run_dir) == list(range(stopped_after))  # the step it was in, recorded
    assert not (run_dir / "final_model").exists()

    run_resumable(tiny_llama_dir, tmp_path, "run", resume=True, num_steps=num_steps)
    reference = run_resumable(tiny_llama_dir, tmp_path, "reference", num_steps=num_steps)

    assert metric_steps(run_dir) == list(range(num_steps))
    assert outcome(run_dir, num_steps) == outcome(reference, num_steps)
    assert_same_final_model(run_dir, reference)


def test_a_stopped_run_closes_its_engines_and_gives_the_handler_back(
    tiny_llama_dir, tmp_path, monkeypatch, handler_before
):
    sigterm_during_optimizer_step(monkeypatch, step=1)
    before = engine_threads()
    with pytest.raises(TrainingStopped) as stopped:
        run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=4, checkpoint_interval=0)
    run_dir = tmp_path / "run"
    assert stopped.value.completed_steps == 2  # the step it was in, finished
    assert stopped.value.checkpoint == run_dir / "checkpoints" / "step_000002"
    assert checkpoint_names(run_dir) == ["step_000002"]
    assert metric_steps(run_dir) == [0, 1]
    assert engine_threads() == before
    assert handler_before.count == 0
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_a_sigterm_while_the_run_loads_stops_it_before_its_first_step(
    tiny_llama_dir, tmp_path, monkeypatch, handler_before
):
    start = RunDirectory.start

    def start_then_sigterm(directory: RunDirectory, *args: Any) -> list[str]:
        signal.raise_signal(signal.SIGTERM)
        return start(directory, *args)

    monkeypatch.setattr(RunDirectory, "start", start_then_sigterm)
    before = engine_threads()
    with pytest.raises(TrainingStopped, match="before step 0, having trained no step"):
        run_resumable(tiny_llama_dir, tmp_path, "run", num_steps=2)
    run_dir = tmp_path / "run"
    assert checkpoint_names(run_dir) == []
    assert not (run_dir / "metrics.jsonl").exists()
    assert engine_threads() == before
    assert handler_before.count == 0


def test_an_async_run_stopped_by_sigterm_resumes_with_no_step_or_task_twice(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch, handler_before
):
    """The groups in flight when it stops are not done: the resumed run plays them again,
    and trains no task twice."""
    tasks = mode_tasks(*[LIVE] * 40)
    settings: dict[str, Any] = {
        "max_steps_off_policy": 1,
        "groups_in_flight": 3,
        "batch_size": 2,
        "num_steps": 4,
        "checkpoint_interval": 0,
        "use_lora": False,
    }
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)
    with monkeypatch.context() as patch:
        sigterm_during_optimizer_step(patch, step=1)
        before = engine_threads()
        with pytest.raises(TrainingStopped, match="after 2 steps"):
            train_multi_turn(
                quick_config(tiny_llama_dir, tmp_path, **settings), tasks, mode_envs(Closes())
            )
    run_dir = tmp_path / "run"
    assert checkpoint_names(run_dir) == ["step_000002"]
    assert engine_threads() == before
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "loop_state.json").read_text())
    assert state["step"] == 2

    config = quick_config(tiny_llama_dir, tmp_path, **settings, resume=True)
    train_multi_turn(config, tasks, mode_envs(Closes()))

    assert metric_steps(run_dir) == [0, 1, 2, 3]
    prompts = Counter(
        record["task"]["prompt"] for step in range(4) for record in train_dump(run_dir, step)
    )
    assert set(prompts.values()) == {config.episodes_per_task}  # no task trained twice
    assert handler_before.count == 0
