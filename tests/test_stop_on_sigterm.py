"""``stop_on_sigterm``, the SIGTERM handler a training call holds while it runs
(``runs/stopping.py``): the first SIGTERM asks the loop to stop, the second goes to the
handler that was there before, which is put back when the call ends; and the CLI's exit
status for a run it stopped.

The training loops' side (they stop after the step they are in, saved, and resume as an
uninterrupted run) is in test_grpo_sigterm.py and test_sft_sigterm.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from post_training_cookbook.cli import commands, main
from post_training_cookbook.runs.stopping import StopRequest, TrainingStopped, stop_on_sigterm


def test_the_handler_is_held_only_while_the_call_runs_and_the_one_before_comes_back(
    handler_before,
):
    with stop_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is not handler_before
    assert signal.getsignal(signal.SIGTERM) is handler_before
    with pytest.raises(RuntimeError, match="the loop failed"), stop_on_sigterm():
        raise RuntimeError("the loop failed")
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert handler_before.count == 0


def test_the_first_sigterm_asks_to_stop_and_the_second_goes_to_the_handler_before(
    handler_before,
):
    with pytest.raises(TrainingStopped), stop_on_sigterm() as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        assert handler_before.count == 0
        signal.raise_signal(signal.SIGTERM)
        assert handler_before.count == 1  # at once, inside the call
        raise stop.stopped(3, Path("runs/x/checkpoints/step_000003"))
    assert handler_before.count == 1  # the loop stopped: nothing more is passed on
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_a_sigterm_too_late_for_a_step_boundary_is_passed_on_once_the_call_returns(
    handler_before,
):
    """A SIGTERM during the final model's save: the call finishes, then the signal does
    what it would have done without the call's handler."""
    with stop_on_sigterm():
        signal.raise_signal(signal.SIGTERM)
        assert handler_before.count == 0
    assert handler_before.count == 1


def test_a_stop_asked_for_while_the_run_loaded_stops_it_before_its_first_step():
    stop = StopRequest()
    stop.check_before_training(4)  # nothing asked: goes on
    stop.signal_name = "SIGTERM"
    with pytest.raises(TrainingStopped) as stopped:
        stop.check_before_training(4)
    assert str(stopped.value) == (
        "stopped by SIGTERM before step 4, having trained no step; resume with resume=True "
        "to continue"
    )
    assert stopped.value.checkpoint is None


def test_a_call_outside_the_main_thread_installs_no_handler(handler_before):
    seen: list[object] = []

    def train_in_a_thread() -> None:
        with stop_on_sigterm() as stop:
            seen.extend([signal.getsignal(signal.SIGTERM), stop.requested])

    thread = threading.Thread(target=train_in_a_thread)
    thread.start()
    thread.join()
    assert seen == [handler_before, False]


def test_with_the_default_handler_a_second_sigterm_ends_the_process_at_once():
    script = (
        "import os, signal, time\n"
        "from post_training_cookbook.runs.stopping import stop_on_sigterm\n"
        "with stop_on_sigterm() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('asked to stop:', stop.requested, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "    print('still running', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == "asked to stop: True\n"


def test_the_cli_exits_with_143_and_the_stop_message_when_a_run_is_stopped(
    monkeypatch, capsys, tmp_path
):
    checkpoint = tmp_path / "runs" / "x" / "checkpoints" / "step_000003"

    def stopped_run(args: object) -> int:
        raise TrainingStopped("SIGTERM", 3, checkpoint)

    monkeypatch.setattr(commands, "run_train", stopped_run)
    assert main(["train", str(tmp_path / "run.yaml")]) == 128 + signal.SIGTERM == 143
    assert capsys.readouterr().err == (
        f"post-training-cookbook train: stopped by SIGTERM after 3 steps (checkpoint "
        f"{checkpoint}); resume with resume=True to continue\n"
    )
