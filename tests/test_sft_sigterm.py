"""A scheduler's SIGTERM during an SFT run (issue 58, item 4): as GRPO's
(test_grpo_sigterm.py), the run finishes the step it is in, saves a checkpoint of it (none
was due on schedule) and raises ``TrainingStopped``; resumed, every step and validation is
in metrics.jsonl once, with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from sft_common import run
from transformers import AutoModelForCausalLM

from post_training_cookbook.runs.stopping import TrainingStopped
from post_training_cookbook.service import LocalModelService


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_an_sft_run_stopped_by_sigterm_resumes_with_the_losses_of_an_uninterrupted_run(
    tiny_llama_dir, tmp_path, monkeypatch, handler_before
):
    num_steps, run_dir = 4, tmp_path / "runs" / "run"
    optim_step, calls = LocalModelService.optim_step, []

    async def optim_step_then_sigterm(service: LocalModelService, learning_rate: float) -> Any:
        calls.append(learning_rate)
        if len(calls) == 2:  # inside step 1
            signal.raise_signal(signal.SIGTERM)
        return await optim_step(service, learning_rate)

    with monkeypatch.context() as patch:
        patch.setattr(LocalModelService, "optim_step", optim_step_then_sigterm)
        with pytest.raises(TrainingStopped) as stopped:
            run(tiny_llama_dir, tmp_path, "run", num_steps=num_steps, checkpoint_interval=0)
    assert stopped.value.completed_steps == 2
    assert stopped.value.checkpoint == run_dir / "checkpoints" / "step_000002"
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_000002"]
    assert [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1]
    assert handler_before.count == 0
    assert signal.getsignal(signal.SIGTERM) is handler_before

    resumed = run(tiny_llama_dir, tmp_path, "run", num_steps=num_steps, resume=True)
    reference = run(tiny_llama_dir, tmp_path, "reference", num_steps=num_steps)

    lines = read_jsonl(resumed.metrics_path)
    assert [line["step"] for line in lines] == [*range(num_steps), num_steps]
    for got, want in zip(lines, read_jsonl(reference.metrics_path), strict=True):
        for key in ("loss/nll", "val/nll", "train/conversations"):
            assert (key in got) == (key in want), (got["step"], key)
            if key in got:
                assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
    AutoModelForCausalLM.from_pretrained(resumed.final_model_dir)
