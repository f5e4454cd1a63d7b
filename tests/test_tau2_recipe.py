"""recipes/tau2/telecom_solo.py end to end on two train and two test tasks of τ²'s telecom
solo mode, with a tiny model built here: the gold actions become SFT's conversations, every
stage runs in order and writes what the report reads, and the report pairs the models'
verdicts on the same tasks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tau2_common import require_tau2, saying_one_token_model

require_tau2()

RECIPES = Path(__file__).parents[1] / "recipes"
sys.path.insert(0, str(RECIPES / "tau2"))
sys.path.insert(0, str(RECIPES))
import stages  # noqa: E402  (recipes/ is not a package)
import telecom_solo  # noqa: E402

from post_training_cookbook.bundled_envs.tau2 import tau2_tasks  # noqa: E402
from post_training_cookbook.bundled_envs.tau2.data import from_task  # noqa: E402

POSITIONS = 40960
"""τ²'s telecom solo prompt is 31,600 of the test tokenizer's tokens (9,900 of Qwen's)."""


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = saying_one_token_model(tmp_path / "tiny", POSITIONS)
    monkeypatch.setattr(telecom_solo, "MODEL", str(model))
    monkeypatch.setattr(telecom_solo, "TRAIN_LIMIT", 2)
    monkeypatch.setattr(telecom_solo, "TEST_LIMIT", 2)
    monkeypatch.setattr(telecom_solo, "GRPO_STEPS", 1)
    monkeypatch.setattr(telecom_solo, "GRPO_GROUP_SIZE", 2)
    monkeypatch.setattr(telecom_solo, "SFT_BATCH_TOKENS", POSITIONS)
    limits = telecom_solo.LIMITS | {"max_model_length": POSITIONS, "max_turns": 4}
    monkeypatch.setattr(telecom_solo, "LIMITS", limits)
    return telecom_solo


def test_the_gold_actions_play_one_call_a_message_then_done():
    tasks = tau2_tasks("telecom", "train", solo=True, limit=2)
    player = telecom_solo.GoldActions(tasks)  # no model: the recipe fixture's is not needed
    ticket = tasks[1].prompt
    prompt = [{"role": "system", "content": f"policy ... {ticket} ..."}]
    calls = telecom_solo.agent_messages(from_task(tasks[1])[1], solo=True)
    assert player.next_message(prompt) == calls[0]
    played = [*prompt, calls[0], {"role": "tool", "content": "ok"}]
    assert player.next_message(played) == calls[1]
    with pytest.raises(ValueError, match="0 tasks' tickets"):
        player.next_message([{"role": "system", "content": "a ticket nobody filed"}])


@pytest.mark.heavy  # ~7 min here beside another job: two SFT and GRPO steps on 31k-token prompts
def test_every_stage_runs_and_the_report_pairs_the_models(recipe, tmp_path: Path):
    out = tmp_path / "run"
    out.mkdir()
    for stage in recipe.STAGE_FUNCTIONS:
        stages.run_stage(recipe.STAGE_FUNCTIONS, stage, out)
        assert (out / f"{stage}.json").exists(), stage

    demos = [json.loads(line) for line in (out / "demos.jsonl").read_text().splitlines()]
    assert json.loads((out / "demos.json").read_text())["kept"] == len(demos) == 2
    for demo in demos:  # the gold calls, then done: τ² gave each its full reward
        names = [m["tool_calls"][0]["function"]["name"] for m in demo["messages"][1:][::2]]
        assert names[-1] == "done" and len(names) >= 2

    start = json.loads((out / "eval_start.json").read_text())
    assert len(start["per_task"]) == 2 and start["pass_1"] == 0.0  # "!!!" is no call
    assert start["endings"]["agent_error"] == 1.0
    assert start["episode_wall_s"] > 0 and start["engine"]["decode_tokens"] > 0
    grpo = json.loads((out / "grpo.json").read_text())
    assert Path(grpo["final_model"]).is_dir()

    report = json.loads((out / "report.json").read_text())
    assert set(report["models"]) == {"start", "sft", "grpo"}
    assert set(report["paired_differences"]) == {
        "sft_over_start",
        "grpo_over_start",
        "grpo_over_sft",
    }
    for row in report["paired_differences"].values():
        assert row["tasks"] == 2 and -1.0 <= row["difference"] <= 1.0
