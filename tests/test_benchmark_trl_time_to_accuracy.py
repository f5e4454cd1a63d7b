"""``benchmarks/trl_time_to_accuracy.py``: the summary's arithmetic (time to TRL's best, the
ratio, "not reached"); the curves' JSONL (steps and wall-clock rising from the start); one
scoring for every side's checkpoints (the same ``evaluate`` call, a TRL LoRA adapter merged
into the start model first); and its ``--smoke`` end to end: ours' side here (the bundled
model, 2 steps, 4 validation tasks); both sides where TRL's venv is (``.venv-trl``:
``requirements/trl-benchmark.txt``), among the heavy tests, as the verifiers venv's are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # not a package
from trl_grpo_sides import LORA_TARGETS, Work
from trl_time_to_accuracy import (
    DIFFERENCES,
    best,
    first_reach,
    score_points,
    summarize,
    time_to,
    where_to_score,
    write_curve,
)

ROOT = Path(__file__).parents[1]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


def point(step: int, train_s: float, reward: float, se: float = 0.05) -> dict:
    return {"step": step, "train_s": train_s, "val_reward": reward, "val_se": se}


START = point(0, 0.0, 0.80)
CURVES = {
    "trl": [START, point(2, 100.0, 0.85), point(4, 200.0, 0.90), point(6, 300.0, 0.88)],
    "ours": [START, point(2, 20.0, 0.84), point(4, 40.0, 0.91), point(6, 60.0, 0.93)],
}


def row(step_s: float) -> dict:
    return {"steps": [{"step_s": step_s, "others": 0.0}] * 3, "setup_s": 5.0, "saving_s": 0.5,
            "note": "", "versions": {}, "wall_s": 30.0}  # fmt: skip


def test_time_to_trls_best_is_each_sides_first_point_at_or_above_it_and_ours_over_trls():
    assert best(CURVES["trl"])["step"] == 4
    assert first_reach(CURVES["ours"], 0.90) == 40.0
    reached = time_to(CURVES, 0.90)
    assert (reached["trl_s"], reached["ours_s"]) == (200.0, 40.0)
    assert reached["ratio"] == pytest.approx(0.2)
    summary = summarize(CURVES, {"trl": row(50.0), "ours": row(10.0)})
    assert summary["trl_improved"] is True
    assert summary["to_trl_best"]["ratio"] == pytest.approx(0.2)
    # one SE below TRL's best (0.85): TRL at 100 s, ours at 40 s
    assert summary["to_trl_best_less_se"]["trl_s"] == 100.0
    assert summary["to_trl_best_less_se"]["ours_s"] == 40.0


def test_a_score_ours_never_reaches_is_not_reached_and_has_no_ratio():
    curves = {"trl": CURVES["trl"], "ours": [START, point(2, 20.0, 0.82)]}
    assert time_to(curves, 0.90) == {
        "threshold": 0.90, "trl_s": 200.0, "ours_s": None, "ratio": None,
    }  # fmt: skip


def test_a_trl_that_never_beats_the_start_is_said_so():
    curves = {"trl": [START, point(2, 100.0, 0.75)], "ours": CURVES["ours"]}
    summary = summarize(curves, {})
    assert summary["trl_improved"] is False
    assert summary["best"]["trl"]["val_reward"] == 0.75


def test_a_curve_is_written_a_line_a_point_and_only_if_its_steps_and_clock_rise(tmp_path):
    path = tmp_path / "ours_metrics.jsonl"
    write_curve(path, CURVES["ours"])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == CURVES["ours"]
    for wrong in (
        [START, point(2, 40.0, 0.9), point(4, 20.0, 0.9)],  # the clock runs back
        [START, point(2, 20.0, 0.9), point(2, 40.0, 0.9)],  # a step twice
        [point(2, 20.0, 0.9), point(4, 40.0, 0.9)],  # no start
        [],
    ):
        with pytest.raises(ValueError, match="do not rise"):
            write_curve(tmp_path / "wrong.jsonl", wrong)
    assert not (tmp_path / "wrong.jsonl").exists()


def work_on(folder: Path) -> Work:
    return Work(
        model=str(folder), folder=str(folder), codec="hermes", tasks=2, group=4, steps=2,
        max_turns=6, max_tokens_per_turn=64, max_model_length=1024, max_completion_length=900,
        learning_rate=1e-4, lora=4, seed=0, ordered_tasks=[], tool_specs=[],
    )  # fmt: skip


def bundled() -> Path:
    from post_training_cookbook.models import BUNDLED_MODEL_DIR

    return Path(BUNDLED_MODEL_DIR)


def test_every_sides_checkpoints_are_scored_by_one_evaluate_call_on_the_same_tasks(
    tmp_path, monkeypatch
):
    import post_training_cookbook.evaluation as evaluation
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS

    trl_weights = tmp_path / "trl" / "step_000002"  # full weights: no adapter to merge
    trl_weights.mkdir(parents=True)
    (trl_weights / "model.safetensors").write_bytes(b"weights")
    run = tmp_path / "ours"
    calls = []

    def scoring(model, tasks, env_factory, episodes, **settings):
        assert (Path(model) / "tokenizer.json").is_file() or Path(model) == run
        calls.append((model, list(tasks), type(env_factory(tasks[0])), episodes, settings))
        per_task = [SimpleNamespace(passed=i % 2, rewards=[float(i % 2)]) for i in range(4)]
        return SimpleNamespace(reward_mean=0.5, per_task=per_task, num_episodes=4, metrics={},
                               termination={})  # fmt: skip

    monkeypatch.setattr(evaluation, "evaluate", scoring)
    points = [
        {"side": "start", "step": 0, "train_s": 0.0, "checkpoint": str(bundled())},
        {"side": "trl", "step": 2, "train_s": 9.0, "checkpoint": str(trl_weights)},
        {"side": "ours", "step": 2, "train_s": 3.0,
         "checkpoint": str(run / "checkpoints" / "step_000002")},
    ]  # fmt: skip
    scored = score_points(work_on(bundled()), points, 4, tmp_path)
    models = [(call[0], call[4].pop("step"), call[4].pop("label")) for call in calls]
    assert models[0] == (str(bundled()), None, "start_step0")
    assert models[2] == (str(run), 2, "ours_step2")  # ours: its run folder at the step
    # TRL: its own weights, with the start model's tokenizer beside them, not its weights
    assert models[1] == (str(trl_weights), None, "trl_step2")
    assert (trl_weights / "model.safetensors").read_bytes() == b"weights"
    assert not (trl_weights / "config.json").exists()
    # the rest of every call is the same: the first 4 validation tasks, one greedy episode
    assert all(call[1:] == calls[0][1:] for call in calls)
    assert calls[0][1] == list(TOOL_USE_GAME_VAL_TASKS[:4]) and calls[0][3] == 1
    assert calls[0][4]["temperature"] == 0.0 and calls[0][4]["dtype"] == "float32"
    assert [p["val_reward"] for p in scored] == [0.5] * 3
    assert scored[0]["val_se"] == pytest.approx(0.2887, abs=1e-4)  # 2 of 4 tasks passed


def test_a_trl_lora_adapter_is_scored_merged_into_the_start_model(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(bundled(), dtype=torch.float32)
    # B random, not zero as training starts it: the adapter changes the logits
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM",
                        init_lora_weights=False)  # fmt: skip
    trained = get_peft_model(base, config).eval()
    adapter = tmp_path / "trl" / "step_000001"
    trained.save_pretrained(adapter)
    ids = torch.tensor([[1, 585, 753, 789, 777, 774]])
    with torch.no_grad():
        expected = trained(ids).logits
        with trained.disable_adapter():
            start = trained(ids).logits
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    point = {"side": "trl", "step": 1, "train_s": 1.0, "checkpoint": str(adapter)}
    folder, step = where_to_score(work_on(bundled()), point, scratch)
    assert (folder, step) == (str(scratch), None)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in scratch.iterdir()
    }  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(ids).logits
    assert not torch.allclose(expected, start, atol=1e-3)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def smoke(out: Path, sides: list[str]) -> str:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p
    )}  # fmt: skip
    command = [sys.executable, str(ROOT / "benchmarks" / "trl_time_to_accuracy.py"), "--smoke",
               "--sides", *sides, "--out", str(out), "--trl-python", str(TRL_PYTHON)]  # fmt: skip
    # a session of its own: on a timeout its children (a side, the evaluator) go with it
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as done:  # fmt: skip
        try:
            stdout, stderr = done.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(done.pid, signal.SIGKILL)
            stdout, stderr = done.communicate()
            pytest.fail(f"the smoke ran past 900 s:\n{(stdout + stderr)[-6000:]}")
    assert done.returncode == 0, (stdout + stderr)[-6000:]
    return stdout


def check_curve(out: Path, side: str) -> list[dict]:
    points = [json.loads(line) for line in (out / f"{side}_metrics.jsonl").read_text().splitlines()]
    assert [p["step"] for p in points] == [0, 1, 2]  # the start, then a checkpoint a step
    assert points[0]["train_s"] == 0.0 < points[1]["train_s"] < points[2]["train_s"]
    for p in points:
        assert p["side"] == side and p["val_episodes"] == 4
        assert 0.0 <= p["val_reward"] <= 1.0 and p["val_se"] >= 0.0
    return points


def test_the_smoke_trains_ours_two_steps_and_scores_the_start_and_each_checkpoint(tmp_path):
    out = tmp_path / "out"
    printed = smoke(out, ["ours"])
    points = check_curve(out, "ours")
    assert (out / "time_to_accuracy.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ours"]["steps"] == 2 and summary["best"]["ours"]["step"] in (1, 2)
    assert summary["differences"] == list(DIFFERENCES)
    assert "what differs between the sides" in printed
    assert sorted(p.name for p in (out / "ours" / "checkpoints").iterdir()) == [
        "step_000001", "step_000002",
    ]  # fmt: skip
    assert points[0]["checkpoint"] == json.loads((out / "work.json").read_text())["folder"]


@pytest.mark.heavy
@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason=f"no TRL venv at {TRL_PYTHON} "
                    "(python -m venv .venv-trl && .venv-trl/bin/pip install -r "
                    "requirements/trl-benchmark.txt)")  # fmt: skip
def test_the_smoke_trains_both_sides_and_reports_time_to_trls_best(tmp_path):
    out = tmp_path / "out"
    printed = smoke(out, ["trl", "ours"])
    trl, ours = check_curve(out, "trl"), check_curve(out, "ours")
    assert trl[0]["val_reward"] == ours[0]["val_reward"]  # one start, scored once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trl"]["steps"] == 2 and summary["trl"]["versions"]["trl"] == "1.16.0"
    assert summary["to_trl_best"]["threshold"] == summary["best"]["trl"]["val_reward"]
    assert summary["tokens"].startswith("tokenization identical on both sides"), summary["tokens"]
    assert "time to TRL's best" in printed
