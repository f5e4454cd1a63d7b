"""BFCL multi-turn scored as BFCL scores it: the step limit and force-quit of BFCL's loop, the
entry verdict and prefix turn count of ``bfcl-eval``'s own runner and checker on recorded and
damaged replies of all four categories (calls in turns that need none, replies that do not
decode), the results file that ``bfcl-eval`` alone re-scores, and the never-call baseline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_bfcl_multi_turn import (
    DAMAGES,
    bfcl_eval_verdict,
    leftover_instances,
    one_call_each,
    play,
    recorded_and_perturbed,
    reply,
)

from post_training_cookbook.bundled_envs.bfcl.backends import DecodedCall
from post_training_cookbook.bundled_envs.bfcl.ground_truth import (
    GroundTruthPlayer,
    NeverCallPlayer,
    ground_truth_call,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MultiTurnEntry,
    load_multi_turn_entries,
)
from post_training_cookbook.bundled_envs.bfcl.results_file import RESULTS_FILE, played_calls
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.sft.demonstrations import ScriptedChat
from post_training_cookbook.types import Message

ROOT = Path(__file__).parents[1]


def rescore_script() -> Any:
    """``scripts/bfcl_rescore.py`` as a module, imported when a test runs: it imports
    ``bfcl-eval`` at its top, and the scale tests' venv (which collects this file) has none."""
    sys.path.insert(0, str(ROOT / "scripts"))  # scripts/ is not a package
    import bfcl_rescore

    return bfcl_rescore


PWD = DecodedCall("pwd", {})
"""A read-only call of the file system backend: it changes no state."""


def rescored(entry: MultiTurnEntry, calls: list, inference_error: str | None = None):
    """``scripts/bfcl_rescore.py``'s judgment (``bfcl-eval`` alone) of a results-file line."""
    bfcl_rescore = rescore_script()
    raw = {e["id"]: e for e in bfcl_rescore.load_dataset_entry(entry.category)}[entry.id]
    truth = [list(turn) for turn in entry.ground_truth]
    line = {"id": entry.id, "result": calls, "inference_error": inference_error}
    return bfcl_rescore.judge(line, truth, raw)


def variant_cases() -> list[tuple[MultiTurnEntry, list[list[Message]]]]:
    """``miss_param``/``miss_func`` entries of the file system: the truth whole, with a call
    made in every turn whose ground truth has none (BFCL executes it and judges it only
    through the state), with the first turn ended by a reply whose arguments do not decode
    instead of text, and with
    every damage of the base cases."""
    entries = [
        e
        for category in ("multi_turn_miss_param", "multi_turn_miss_func")
        for e in load_multi_turn_entries([category])[:4]
        if "GorillaFileSystem" in e.involved_classes
    ]
    cases = []
    for entry in entries:
        truth = [[ground_truth_call(entry, call) for call in turn] for turn in entry.ground_truth]
        cases.append((entry, [one_call_each(calls or [PWD]) for calls in truth]))
        cases.append((entry, [
            [*one_call_each(calls)[:-1], reply(PWD, arguments="{'not': json}")] if index == 0
            else one_call_each(calls)
            for index, calls in enumerate(truth)
        ]))  # fmt: skip
        for damage in DAMAGES:
            cases.append((entry, [damage(index, calls) for index, calls in enumerate(truth)]))
    return cases


def test_entry_verdicts_and_prefixes_equal_bfcl_evals_on_every_category(bfcl_handler):
    cases = recorded_and_perturbed() + variant_cases()
    seen = {"verdicts": set(), "prefixes": set(), "ours_stricter": 0}
    for entry, turns in cases:
        queue = [r for replies in turns for r in replies]
        env = asyncio.run(play(entry, lambda messages, queue=queue: queue.pop(0)))
        assert not queue, entry.id
        assert env.entry_verdict is not None
        theirs = bfcl_eval_verdict(bfcl_handler, entry, turns)
        assert env.entry_verdict.valid == theirs, entry.id
        # the results file's calls, read back from the conversation, judged by bfcl-eval alone
        calls = played_calls(entry, env.messages)
        assert rescored(entry, calls) == (theirs, env.prefix_turns), entry.id
        seen["verdicts"].add(theirs)
        seen["prefixes"].add(env.prefix_turns)
        ours = sum(verdict.valid for verdict in env.turn_verdicts)
        seen["ours_stricter"] += theirs and ours < len(entry.turns)
    assert seen["verdicts"] == {True, False}
    assert len(seen["prefixes"]) >= 3  # first turn failing, a middle one, none
    assert seen["ours_stricter"] > 0  # valid entries whose call in an empty turn we fail
    assert not leftover_instances()


def test_a_reply_past_the_step_limit_runs_then_the_entry_is_force_quit(bfcl_handler):
    entry = load_multi_turn_entries(["multi_turn_base"])[0]
    forever = reply(PWD)
    env = asyncio.run(play(entry, lambda messages: forever, max_steps_per_turn=3))
    assert env.entry_verdict is not None
    assert env.entry_verdict.error_type == "multi_turn:force_terminated"
    assert len([m for m in env.messages if m["role"] == "tool"]) == 4  # BFCL: count > limit
    assert bfcl_eval_verdict(bfcl_handler, entry, [[forever] * 4]) is False
    assert rescored(entry, played_calls(entry, env.messages)) == (False, env.prefix_turns)


def test_a_force_quit_in_the_last_turn_is_still_judged_by_the_checker(bfcl_handler):
    """BFCL appends the force-quit turn before it stops: with every turn played, its checker
    judges the entry, and the truth followed by read-only calls passes."""
    entry = next(
        e
        for e in load_multi_turn_entries(["multi_turn_base"])
        if e.involved_classes == ("GorillaFileSystem",) and all(e.ground_truth)
    )
    truth = GroundTruthPlayer([entry])
    last = len(entry.turns) - 1

    def truth_then_pwd(messages: list[Message]) -> Message:
        message = truth.next_message(messages)
        in_last_turn = sum(m["role"] == "user" for m in messages) > last
        return reply(PWD) if in_last_turn and not message.get("tool_calls") else message

    most = max(len(calls) for calls in entry.ground_truth)  # no earlier turn is force-quit
    rewards: list[float] = []
    env = asyncio.run(play(entry, truth_then_pwd, rewards, max_steps_per_turn=most))
    assert rewards[-1] == 1.0  # reward="entry": BFCL accepts the entry
    assert env.messages[-1]["role"] == "tool"  # ended by the force-quit, not a text reply
    assert env.turn_verdicts[-1].error_type == "multi_turn:force_terminated"  # ours fails it
    assert env.entry_verdict is not None and env.entry_verdict.valid
    assert env.prefix_turns == len(entry.turns)
    prefix_rewards: list[float] = []
    asyncio.run(
        play(entry, truth_then_pwd, prefix_rewards, reward="prefix", max_steps_per_turn=most)
    )
    assert sum(prefix_rewards) == pytest.approx(1.0)  # every turn, the forced last one too
    played = played_calls(entry, env.messages)
    assert rescored(entry, played) == (True, len(entry.turns))
    assert rescored(entry, played, inference_error="context_overflow") == (False, last)


def test_the_never_call_baseline_scores_what_the_ground_truth_allows(tmp_path):
    categories = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_miss_func")
    result = evaluate(
        ScriptedChat(NeverCallPlayer()),
        benchmark="bfcl_multi_turn:" + ",".join(categories) + "@held_out",
        limit=4,
        max_turns=60,
        max_model_length=100_000,
        runs_dir=tmp_path,
    )
    score = result.benchmark
    assert score is not None and result.output_dir is not None
    for category in categories:
        entries = load_multi_turn_entries([category], "held_out", limit=4)
        turns = sum(len(e.turns) for e in entries)
        leading_empty = sum(
            next((i for i, calls in enumerate(e.ground_truth) if calls), len(e.turns))
            for e in entries
        )
        empty = sum(not calls for e in entries for calls in e.ground_truth)
        assert score.accuracy[category] == 0.0
        assert score.prefix_turns[category].correct == leading_empty
        assert score.turns[category].correct == empty  # ours passes every empty turn
        assert score.turns[category].total == score.prefix_turns[category].total == turns
    assert score.turns["multi_turn_miss_param"].correct > 0  # the gap ours leaves open
    # bfcl-eval alone, in a process of its own, re-scores the file to the same verdicts
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bfcl_rescore.py"), "--json",
         str(Path(result.output_dir) / RESULTS_FILE)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    report = json.loads(done.stdout)
    assert report["disagreements"] == []
    assert report["per_category"]["pooled"]["entries"] == 12
    assert report["per_category"]["pooled"]["entry_accuracy"] == 0.0


def test_an_episode_the_rollout_cut_short_is_an_inference_error_in_the_results_file(tmp_path):
    result = evaluate(
        ScriptedChat(NeverCallPlayer()),
        benchmark="bfcl_multi_turn:miss_func@held_out",
        limit=3,
        max_turns=1,  # the rollout ends every episode after its first reply
        runs_dir=tmp_path,
    )
    assert result.output_dir is not None
    lines = [
        json.loads(line)
        for line in (Path(result.output_dir) / RESULTS_FILE).read_text().splitlines()
    ]
    assert [line["inference_error"] for line in lines] == ["the episode ended early: max_turns"] * 3
    report = rescore_script().rescore(Path(result.output_dir) / RESULTS_FILE)
    assert report["disagreements"] == []  # the unfinished turn counts as failing on both sides
    assert report["per_category"]["pooled"]["entry_accuracy"] == 0.0


def test_a_multi_turn_benchmark_is_scored_under_its_own_bounds_unless_told(tmp_path):
    spec = "bfcl_multi_turn:base@held_out"
    usual = evaluate(ScriptedChat(NeverCallPlayer()), benchmark=spec, limit=1, runs_dir=None)
    assert (usual.settings.limits.max_turns, usual.settings.limits.max_model_length) == (
        200,
        16384,
    )
    told = evaluate(
        ScriptedChat(NeverCallPlayer()), benchmark=spec, limit=1, max_turns=7, runs_dir=None
    )
    assert told.settings.limits.max_turns == 7
    assert told.settings.limits.max_model_length == 16384
