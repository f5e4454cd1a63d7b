"""``recipes/bfcl/protocol_run.py``, BFCL run 2: what each stage plays (held-out scores on
held-out entries only, every sample a training stage sees from train entries only), the order
the protocol fixes, the kept part of an RFT sample, and the report's paired gains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    held_out_scenarios,
    load_multi_turn_entries,
)
from post_training_cookbook.types import Message

RECIPE = Path(__file__).parents[1] / "recipes" / "bfcl" / "protocol_run.py"
sys.path.insert(0, str(RECIPE.parent))
sys.path.insert(0, str(RECIPE.parents[1]))  # recipes/stages.py
import protocol_report  # noqa: E402  (recipes/ is not a package)


@pytest.fixture(scope="module")
def recipe():
    import protocol_run

    return protocol_run


def test_held_out_scores_cover_every_held_out_entry_of_the_four_categories(recipe):
    entries = [e for c in recipe.CATEGORIES for e in recipe.held_out(c)]
    assert len(entries) == 208 and sum(len(e.turns) for e in entries) == 876
    assert {e.scenario for e in entries} == set(held_out_scenarios())


def test_the_parts_hold_every_held_out_entry_once_with_whole_backend_groups(recipe):
    parts = [recipe.held_out_part(part) for part in range(1, recipe.PARTS + 1)]
    ids = [entry.id for part in parts for entry in part]
    assert len(ids) == len(set(ids)) == 208
    groups = [{entry.involved_classes for entry in part} for part in parts]
    assert all(not a & b for i, a in enumerate(groups) for b in groups[i + 1 :])
    assert all(0.4 < len(part) * recipe.PARTS / 208 < 2 for part in parts)  # near an even cut
    # a group's entries side by side, a scenario's categories next to each other
    for part in parts:
        keys = [(e.involved_classes, e.scenario) for e in part]
        assert keys == sorted(keys)


def test_the_train_parts_hold_every_train_entry_once_with_whole_scenarios(recipe):
    parts = [recipe.train_part(part) for part in range(1, recipe.TRAIN_PARTS + 1)]
    ids = [entry.id for part in parts for entry in part]
    train = {e.id for c in recipe.CATEGORIES for e in recipe.train_entries(c)}
    assert len(ids) == len(set(ids)) == len(train) == 204 and set(ids) == train
    scenarios = [{(e.involved_classes, e.scenario) for e in part} for part in parts]
    assert all(not a & b for i, a in enumerate(scenarios) for b in scenarios[i + 1 :])
    assert all(0.5 < len(part) * recipe.TRAIN_PARTS / 204 < 1.5 for part in parts)


def test_cutting_the_train_entries_left_the_held_out_parts_as_they_were_scored(recipe):
    """Parts 1-5 of (c) were scored before ``in_parts`` took a unit: the same entries, in the
    same order (the committed stage files list them in play order)."""
    run = Path(__file__).parents[1] / "docs" / "runs" / "bfcl_multi_turn" / "run2"
    for part in range(1, 6):
        scored = json.loads((run / f"eval_sft_part{part}.json").read_text())["per_entry"]
        assert [entry.id for entry in recipe.held_out_part(part)] == list(scored)


def test_grpo_starts_from_the_model_with_the_higher_pooled_train_score(recipe, tmp_path):
    def stage(name: str, part: int, prefix: list[int]) -> None:
        per_entry = {
            f"e{part}": {"turns": 4, "prefix_turns": prefix, "valid": [p == 4 for p in prefix]}
        }
        (tmp_path / f"{name}_part{part}.json").write_text(json.dumps({"per_entry": per_entry}))

    for part in range(1, recipe.TRAIN_PARTS + 1):
        # (c) better on the first part, (d) better pooled over all of them
        stage("rft_samples", part, [4, 4, 4] if part == 1 else [0, 0, 1])
        stage("train_score_rft", part, [0, 0, 0] if part == 1 else [1, 1, 1])
    assert recipe.grpo_start(tmp_path) == str(tmp_path / "rft" / "final_model")
    (tmp_path / "train_score_rft_part2.json").unlink()
    with pytest.raises(SystemExit, match=r"train_score_rft_part2\.json is missing"):
        recipe.grpo_start(tmp_path)


def test_the_train_score_pools_every_sampled_turn(recipe):
    rows = {
        "a": {"turns": 2, "prefix_turns": [2, 0, 1], "valid": [True, False, False]},
        "b": {"turns": 4, "prefix_turns": [4, 4, 0], "valid": [True, True, False]},
    }
    score = recipe.train_score(rows)
    assert score["prefix_turn_accuracy"] == pytest.approx((3 + 8) / (6 + 12))
    assert score["entry_accuracy"] == pytest.approx(3 / 6)
    assert (score["turns_sampled"], score["samples"]) == (18, 6)


def test_training_stages_sample_train_entries_only(recipe, monkeypatch):
    """``train_tasks`` (GRPO) and RFT's samples read ``train_entries``; with the prompt bound
    lifted, those are the train split's entries."""

    def unbounded(category: str):
        return load_multi_turn_entries([category], "train")

    monkeypatch.setattr(recipe, "train_entries", unbounded)
    tasks = recipe.train_tasks()
    scenarios = {int(t.metadata["bfcl_multi_turn"]["id"].rsplit("_", 1)[1]) for t in tasks}
    assert len(tasks) == 592 and not scenarios & set(held_out_scenarios())


def test_the_stages_run_in_the_protocols_order(recipe):
    names = list(recipe.STAGE_FUNCTIONS)
    at = {name: names.index(name) for name in names}
    assert names[:2] == ["demos", "sft"] and names[-1] == "report"
    before_grpo = [n for n in names if n.startswith(("eval_", "rft", "train_score", "best_of"))]
    grpo_scores = [n for n in before_grpo if n.startswith("eval_grpo")]
    # GRPO reads (c)'s and (d)'s train scores: every baseline comes first
    assert all(at[n] < at["grpo_seed0"] for n in before_grpo if n not in grpo_scores)
    assert len(grpo_scores) == recipe.PARTS and all(at[n] > at["grpo_seed0"] for n in grpo_scores)
    assert at["rft"] > max(at[n] for n in names if n.startswith("rft_samples_"))
    assert recipe.GRPO_EPISODE_BUDGET == 576
    assert recipe.RFT_SAMPLES * 204 >= recipe.GRPO_EPISODE_BUDGET  # 204 train entries


def test_an_rft_sample_is_kept_up_to_the_end_of_its_passed_turns(recipe):
    def user(text: str) -> Message:
        return Message(role="user", content=text)

    def said(text: str) -> Message:
        return Message(role="assistant", content=text)

    messages = [
        Message(role="system", content="s"), user("one"), said("a"), said("Done."),
        user("two"), user("two, more"), said("Done."), user("three"), said("no"),
    ]  # fmt: skip
    assert recipe.passed_turns(messages, 1) == messages[:4]
    assert recipe.passed_turns(messages, 2) == messages[:7]
    assert recipe.passed_turns(messages, 3) == messages


def test_paired_gains_count_a_scenarios_four_entries_as_one_cluster():
    def rows(valid: dict[str, int], prefix: dict[str, int]) -> dict[str, dict]:
        return {i: {"valid": valid[i], "prefix_turns": prefix[i], "turns": 4} for i in valid}

    ids = [f"multi_turn_{c}_{s}" for s in (1, 2, 3) for c in ("base", "miss_func")]
    before = rows(dict.fromkeys(ids, 0), dict.fromkeys(ids, 0))
    after = rows(
        {i: int(i.endswith(("_1", "_2"))) for i in ids},
        {i: 4 if i.endswith(("_1", "_2")) else 1 for i in ids},
    )
    entry = protocol_report.paired_gain(before, after, "valid")
    prefix = protocol_report.paired_gain(before, after, "prefix_turns")
    assert entry["gain"] == pytest.approx(4 / 6)
    assert prefix["gain"] == pytest.approx((4 + 4 + 4 + 4 + 1 + 1) / 24)
    # three clusters, not six entries: the SE of the scenario totals
    from post_training_cookbook.evaluation.benchmarks import clustered_se

    assert entry["se"] == pytest.approx(clustered_se([(2, 2), (2, 2), (0, 2)]))


def test_the_report_reads_the_stages_that_ran(recipe, tmp_path):
    entries = recipe.held_out("multi_turn_base")
    per_entry = {
        e.id: {"turns": len(e.turns), "valid": False, "prefix_turns": 0, "turns_valid_ours": 0}
        for e in entries
    }
    (tmp_path / "eval_never_call_base.json").write_text(json.dumps({"per_entry": per_entry}))
    report = recipe.report(tmp_path)
    base = report["models"]["never_call"]["multi_turn_base"]
    assert base["entries"] == 52 and base["prefix_turn_count"] == 193
    assert base["prefix_turn_seen_count"] + base["prefix_turn_unseen_count"] == 193
    assert report["paired_gains"] == {}  # no model has all four categories yet


def test_the_report_pools_a_models_parts_by_category(recipe, tmp_path):
    def stage(name: str, entries, valid: bool) -> None:
        rows = {
            e.id: {"turns": len(e.turns), "valid": valid, "prefix_turns": len(e.turns) * valid,
                   "turns_valid_ours": 0, "category": e.category}
            for e in entries
        }  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps({"per_entry": rows}))

    for category in recipe.CATEGORIES:
        stage(
            f"eval_never_call_{category.removeprefix('multi_turn_')}",
            recipe.held_out(category),
            False,
        )
    first, *rest = range(1, recipe.PARTS + 1)
    for part in (first, *rest):
        stage(f"eval_grpo_seed0_part{part}", recipe.held_out_part(part), part == first)
    report = recipe.report(tmp_path)
    pooled = report["models"]["grpo_seed0"]["pooled"]
    assert pooled["entries"] == 208
    assert pooled["entry_accuracy"] == pytest.approx(len(recipe.held_out_part(first)) / 208)
    assert set(report["models"]["grpo_seed0"]) == {*recipe.CATEGORIES, "pooled"}
    gain = report["paired_gains"]["grpo_seed0_over_never_call"]["valid"]["gain"]
    assert gain == pytest.approx(pooled["entry_accuracy"])
    # with a part missing, a model is reported but not compared
    (tmp_path / f"eval_grpo_seed0_part{first}.json").unlink()
    assert recipe.report(tmp_path)["paired_gains"] == {}


def test_training_stages_refuse_a_cpu_whose_bf16_is_slower_than_fp32(recipe, monkeypatch, tmp_path):
    import stages

    monkeypatch.setattr(stages, "bf16_speedup", lambda: 0.11)
    with pytest.raises(SystemExit, match=r"rft: this CPU multiplies bf16 9\.1x slower"):
        recipe.sft_config(tmp_path, "model", "rft")
    with pytest.raises(SystemExit, match="grpo_seed0"):
        recipe.grpo(tmp_path)
    monkeypatch.setattr(stages, "bf16_speedup", lambda: 2.3)
    assert recipe.sft_config(tmp_path, "model", "rft").trainer_precision == "bf16"


def test_the_bf16_speedup_is_measured_on_this_cpu():
    import stages

    assert 0.01 < stages.bf16_speedup(rows=64, width=128, out=256) < 100


def test_a_stage_file_records_its_time_peak_memory_and_machine(tmp_path):
    import stages

    stages.run_stage(
        {"probe": lambda out: {"made": bytearray(64 * 2**20)[:1] == b"\0"}}, "probe", tmp_path
    )
    record = json.loads((tmp_path / "probe.json").read_text())
    assert record["made"] is True and record["wall_s"] >= 0
    assert record["peak_rss_gib"] >= 64 / 1024  # the stage's own 64 MiB at least
    assert {"cpu", "cores", "bf16_over_fp32"} <= set(record["machine"])


def test_help_lists_the_stages_and_runs_none(monkeypatch, tmp_path, capsys):
    import stages

    ran = []
    functions = {"first": lambda out: ran.append("first") or {}, "second": lambda out: {}}
    script = tmp_path / "recipe.py"
    script.write_text('"""What the recipe does."""\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    stages.stages_main(str(script), functions, default_out="runs/recipe")
    printed = capsys.readouterr().out
    assert "What the recipe does." in printed and "first, second" in printed
    assert ran == [] and not (tmp_path / "runs").exists()
    monkeypatch.setattr(sys, "argv", [str(script), "--stage", "third", str(tmp_path)])
    with pytest.raises(SystemExit, match="no stage 'third'; the stages: first, second"):
        stages.stages_main(str(script), functions, default_out="runs/recipe")
