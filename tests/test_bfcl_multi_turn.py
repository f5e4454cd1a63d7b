"""BFCL's multi-turn categories on ``bfcl-eval``'s backends and checker: the ground truth played
through our env passes on every entry, our entry verdicts equal bfcl-eval's own runner's on
recorded replies, the train and held-out split never share a scenario, and ``evaluate``
scores a model on ``bfcl_multi_turn`` with entry and per-turn accuracy."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from post_training_cookbook.bundled_envs.bfcl.backends import Backends, DecodedCall, forget
from post_training_cookbook.bundled_envs.bfcl.ground_truth import (
    GroundTruthPlayer,
    ground_truth_call,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MULTI_TURN_CATEGORIES,
    MultiTurnEntry,
    held_out_scenarios,
    load_multi_turn_entries,
    scenario_split,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_env import BFCLMultiTurnEnv
from post_training_cookbook.bundled_envs.bfcl.package import bfcl_multi_turn
from post_training_cookbook.envs.base import Task
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.evaluation.benchmarks import BenchmarkSpec, clustered_se
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.types import Message

RECORDED = Path(__file__).parent / "data" / "bfcl_multi_turn_recorded.jsonl"
"""Qwen2.5-Coder-0.5B-Instruct's zero-shot greedy replies to 8 train entries (one a user
turn, each a fenced JSON call), read as calls by the Hermes codec's lenient JSON parser,
each turn then closed by an empty reply: 30 real calls, most of them wrong."""

Reply = Message
Policy = Callable[[list[Message]], Message]


async def play(
    entry: MultiTurnEntry, policy: Policy, rewards: list[float] | None = None, **options
) -> BFCLMultiTurnEnv:
    """Play ``entry`` to its end with ``policy``; each step's reward is appended to
    ``rewards`` when given."""
    env = BFCLMultiTurnEnv(**options)
    messages = await env.reset(entry.to_task())
    try:
        while True:
            result = await env.step(policy(messages))
            if rewards is not None:
                rewards.append(result.reward)
            messages = result.messages
            if result.terminated or result.truncated:
                return env
    finally:
        await env.close()


def leftover_instances() -> list[str]:
    return [key for key in vars(bfcl_multi_turn().utils) if key.startswith("ptc_")]


# -- the split ---------------------------------------------------------------------------


def test_train_and_held_out_never_share_a_scenario_in_any_category():
    train = {e.scenario for e in load_multi_turn_entries(MULTI_TURN_CATEGORIES, "train")}
    held_out = {e.scenario for e in load_multi_turn_entries(MULTI_TURN_CATEGORIES, "held_out")}
    assert not train & held_out
    assert train | held_out == set(range(200))
    assert held_out == held_out_scenarios() and len(held_out) == 52
    assert {scenario_split(n) for n in held_out} == {"held_out"}


def test_every_backend_group_is_held_out_in_part_and_categories_share_scenarios():
    by_scenario: dict[int, tuple[str, ...]] = {}
    for entry in load_multi_turn_entries(MULTI_TURN_CATEGORIES):
        classes = tuple(sorted(entry.involved_classes))
        assert by_scenario.setdefault(entry.scenario, classes) == classes, entry.id
    groups: dict[tuple[str, ...], set[str]] = {}
    for scenario, classes in by_scenario.items():
        groups.setdefault(classes, set()).add(scenario_split(scenario))
    assert all("held_out" in sides for sides in groups.values())
    assert sum(sides == {"held_out", "train"} for sides in groups.values()) >= 15


# -- the ground truth through the env -----------------------------------------------------


@pytest.mark.parametrize("category", MULTI_TURN_CATEGORIES)
def test_the_ground_truth_played_through_the_env_passes_every_entry(category):
    entries = load_multi_turn_entries([category])
    player = GroundTruthPlayer(entries)

    async def all_entries() -> list[BFCLMultiTurnEnv]:
        return [await play(entry, player.next_message, reward="turns") for entry in entries]

    envs = asyncio.run(all_entries())
    assert len(envs) == 200
    for entry, env in zip(entries, envs, strict=True):
        assert env.entry_verdict is not None and env.entry_verdict.valid, entry.id
        assert [v.valid for v in env.turn_verdicts] == [True] * len(entry.turns), entry.id
    assert not leftover_instances()


def test_rewards_entry_or_turn_shares_and_a_wrong_turn_fails_only_itself():
    entry = next(e for e in load_multi_turn_entries(["multi_turn_base"]) if len(e.turns) >= 3)
    player = GroundTruthPlayer([entry])
    rewards: list[float] = []

    def skip_turn_one(messages: list[Message]) -> Message:
        turn = sum(m["role"] == "user" for m in messages) - 1
        if turn == 1:
            return Message(role="assistant", content="Sure.")
        return player.next_message(messages)

    def run(reward: str) -> BFCLMultiTurnEnv:
        rewards.clear()
        return asyncio.run(play(entry, skip_turn_one, rewards, reward=reward))

    env = run("turns")
    assert env.entry_verdict is not None and not env.entry_verdict.valid
    assert env.turn_verdicts[1].error_type == "multi_turn:empty_turn_model_response"
    assert env.turn_verdicts[0].valid
    assert sum(rewards) == pytest.approx(sum(v.valid for v in env.turn_verdicts) / len(entry.turns))
    env = run("entry")
    assert rewards[-1] == 0.0 and set(rewards) == {0.0}


def test_calls_reward_credits_each_right_call_and_is_whole_only_on_a_valid_turn():
    """``reward="calls"``: a turn that drops the last of its ground-truth calls fails BFCL's
    checks but earns a share for what it got right; a valid turn earns exactly what
    ``"turns"`` pays; the rewards sum to the turns' credits over T."""
    entries = load_multi_turn_entries(["multi_turn_base"])
    entry, turn = next(
        (e, k) for e in entries for k, calls in enumerate(e.ground_truth) if len(calls) >= 3
    )
    player = GroundTruthPlayer([entry], max_steps_per_turn=1)  # a turn's calls in one reply

    def drop_last_call_of_the_turn(messages: list[Message]) -> Message:
        reply = player.next_message(messages)
        user_turn = sum(m["role"] == "user" for m in messages) - 1
        if user_turn == turn and reply.get("tool_calls"):
            reply["tool_calls"] = reply["tool_calls"][:-1]
        return reply

    def run(reward: str) -> tuple[BFCLMultiTurnEnv, list[float]]:
        rewards: list[float] = []
        env = asyncio.run(play(entry, drop_last_call_of_the_turn, rewards, reward=reward))
        assert len(env.turn_verdicts) == len(entry.turns)  # every turn played to its check
        return env, rewards

    env, rewards = run("calls")
    verdicts = env.turn_verdicts
    assert not verdicts[turn].valid and all(v.valid for v in verdicts[:turn])
    checks = len(entry.ground_truth[turn]) + 1  # one per ground-truth result, and the state
    credit = verdicts[turn].graded
    assert 1 <= round(credit * checks) <= checks - 1  # the kept calls' results are found
    assert credit * checks == pytest.approx(round(credit * checks))
    assert [v.graded for v in verdicts if v.valid] == [1.0] * sum(v.valid for v in verdicts)
    turn_ends = [r for r in rewards if r != 0.0]
    assert turn_ends[: turn + 1] == pytest.approx(
        [1 / len(entry.turns)] * turn + [credit / len(entry.turns)]
    )
    assert sum(rewards) == pytest.approx(sum(v.graded for v in verdicts) / len(entry.turns))
    assert env._metrics()["bfcl_mt_turn_credit"] == pytest.approx(sum(rewards))
    turns_env, turns_rewards = run("turns")
    assert [v.valid for v in turns_env.turn_verdicts] == [v.valid for v in verdicts]
    assert sum(rewards) > sum(turns_rewards)


def test_held_back_functions_arrive_at_their_turn_in_bfcls_words():
    entry = load_multi_turn_entries(["multi_turn_miss_func"])[0]
    ((turn, docs),) = entry.added_functions.items()
    (opening,) = entry.opening(turn)
    assert opening["content"].endswith(bfcl_multi_turn().added_functions_prompt)
    for doc in docs:
        assert f'"name": "{doc["name"]}"' in opening["content"]
        assert doc["name"] not in {spec["function"]["name"] for spec in entry.tool_specs}


def test_calls_that_name_no_backend_method_never_reach_eval(tmp_path):
    entry = load_multi_turn_entries(["multi_turn_base"])[0]  # the file system
    backends = Backends(entry, "model")
    marker = tmp_path / "written"
    hostile = [
        DecodedCall("open", {"file": str(marker), "mode": "w"}),
        DecodedCall("execute_multi_turn_func_call", {"func_call_list": ["open('x', 'w')"]}),
        DecodedCall("ls", {"a=__import__('os').system('touch " + str(marker) + "'),b": 1}),
        DecodedCall("__import__", {"name": "os"}),
    ]
    try:
        results = backends.run(hostile)
    finally:
        backends.close()
    assert all(result.startswith("Error during execution: ") for result in results)
    assert not marker.exists()
    assert not leftover_instances()


def test_ground_truth_calls_name_every_argument():
    entry = next(e for e in load_multi_turn_entries(["multi_turn_base"]) if e.scenario == 0)
    call = ground_truth_call(entry, "sort('final_report.pdf')")
    assert call == DecodedCall("sort", {"file_name": "final_report.pdf"})
    with pytest.raises(ValueError, match="no backend"):
        ground_truth_call(entry, "buy_stock(symbol='X')")


def test_bad_env_options_are_refused():
    with pytest.raises(ValueError, match="reward"):
        BFCLMultiTurnEnv(reward="final")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_steps_per_turn"):
        BFCLMultiTurnEnv(max_steps_per_turn=0)
    with pytest.raises(ValueError, match="not a BFCL multi-turn task"):
        asyncio.run(BFCLMultiTurnEnv().reset(Task("hi")))


# -- our verdicts against bfcl-eval's own runner ------------------------------------------


def recorded_and_perturbed() -> list[tuple[MultiTurnEntry, list[list[Reply]]]]:
    """Replies per turn: the recorded model's, and the ground truth's, whole and damaged
    (a call dropped, an argument changed, an unknown function, arguments that are not JSON,
    which end the turn, all of a turn's calls in one reply, a call repeated, a turn answered
    in text)."""
    entries = {e.id: e for e in load_multi_turn_entries(["multi_turn_base"])}
    cases = []
    for line in RECORDED.read_text().splitlines():
        record = json.loads(line)
        cases.append((entries[record["id"]], record["turns"]))
    for entry in list(entries.values())[:12]:
        truth = [[ground_truth_call(entry, call) for call in turn] for turn in entry.ground_truth]
        for damage in DAMAGES:
            cases.append((entry, [damage(index, calls) for index, calls in enumerate(truth)]))
    return cases


def one_call_each(calls: list[DecodedCall]) -> list[Reply]:
    return [reply(call) for call in calls] + [Message(role="assistant", content="Done.")]


def reply(*calls: DecodedCall, arguments: str | None = None) -> Reply:
    tool_calls = [
        {"id": f"c{i}", "type": "function",
         "function": {"name": c.name, "arguments": arguments or json.dumps(c.arguments)}}
        for i, c in enumerate(calls)
    ]  # fmt: skip
    return Message(role="assistant", content="", tool_calls=tool_calls)  # type: ignore[typeddict-item]


def _changed(call: DecodedCall) -> DecodedCall:
    arguments = dict(call.arguments)
    for key, value in arguments.items():
        arguments[key] = f"{value}_x" if isinstance(value, str) else value
        break
    return DecodedCall(call.name, arguments)


DAMAGES: list[Callable[[int, list[DecodedCall]], list[Reply]]] = [
    lambda turn, calls: one_call_each(calls),
    lambda turn, calls: one_call_each(calls[:-1] if turn == 0 else calls),
    lambda turn, calls: one_call_each([_changed(calls[0]), *calls[1:]] if calls else calls),
    lambda turn, calls: one_call_each([DecodedCall("teleport", {"x": 1}), *calls]),
    lambda turn, calls: [reply(*calls, arguments="{not json")] if turn == 0 and calls else
    one_call_each(calls),
    lambda turn, calls: [reply(*calls), Message(role="assistant", content="ok")] if calls else
    one_call_each(calls),
    lambda turn, calls: one_call_each([*calls, *calls[:1]]),
    lambda turn, calls: [Message(role="assistant", content="I will not.")] if turn == 1 else
    one_call_each(calls),
]  # fmt: skip


def bfcl_model_result(turns: list[list[Reply]]) -> list[list[object]]:
    """The replies as BFCL's OpenAI FC handler records them: per step, a ``{name:
    arguments}`` per call, or the reply's text."""
    return [
        [
            [{c["function"]["name"]: c["function"]["arguments"]} for c in r["tool_calls"]]
            if r.get("tool_calls")
            else r.get("content", "")
            for r in replies
        ]
        for replies in turns
    ]


def bfcl_eval_verdict(handler, entry: MultiTurnEntry, turns: list[list[Message]]) -> bool:
    """``bfcl-eval``'s runner on the replies, as BFCL's OpenAI FC handler records them."""
    from bfcl_eval.eval_checker.eval_runner import _evaluate_single_multi_turn_entry

    prompt = {
        "id": entry.id,
        "initial_config": copy.deepcopy(entry.initial_config),
        "involved_classes": list(entry.involved_classes),
    }
    theirs = _evaluate_single_multi_turn_entry(
        handler, entry.id, bfcl_model_result(turns),
        [list(calls) for calls in entry.ground_truth], prompt, "ptc_bfcl_runner", entry.category,
    )  # fmt: skip
    forget("ptc_bfcl_runner")
    return bool(theirs["valid"])


def test_entry_verdicts_equal_bfcl_evals_runner_on_recorded_and_damaged_replies(bfcl_handler):
    cases = recorded_and_perturbed()
    assert len(cases) == 12 * len(DAMAGES) + 8
    verdicts = []
    for entry, turns in cases:
        queue = [r for replies in turns for r in replies]
        env = asyncio.run(play(entry, lambda messages, queue=queue: queue.pop(0)))
        assert not queue, entry.id  # the env ended each turn where the replies did
        theirs = bfcl_eval_verdict(bfcl_handler, entry, turns)
        assert env.entry_verdict is not None
        assert env.entry_verdict.valid == theirs, entry.id
        verdicts.append(theirs)
    assert True in verdicts and False in verdicts  # both verdicts are exercised
    assert not leftover_instances()


# -- evaluation ---------------------------------------------------------------------------


def test_benchmark_specs_parse_categories_and_the_split():
    spec = BenchmarkSpec.parse("bfcl_multi_turn")
    assert spec.categories == ("multi_turn_base",) and spec.split == "all"
    spec = BenchmarkSpec.parse("bfcl_multi_turn:base,miss_func@held_out")
    assert spec.categories == ("multi_turn_base", "multi_turn_miss_func")
    assert spec.split == "held_out" and str(spec).endswith("@held_out")
    with pytest.raises(ValueError, match="unknown BFCL multi-turn categories"):
        BenchmarkSpec.parse("bfcl_multi_turn:simple_python")
    with pytest.raises(ValueError, match="unknown split"):
        BenchmarkSpec.parse("bfcl_multi_turn@test")
    with pytest.raises(ValueError, match="only bfcl_multi_turn has a split"):
        BenchmarkSpec.parse("bfcl@held_out")


def test_clustered_standard_error():
    assert clustered_se([(1, 2), (1, 2)]) == 0.0  # every entry at the mean
    # p = 0.5; residuals +1, -1; sqrt(2 * 2/1) / 4
    assert clustered_se([(2, 2), (0, 2)]) == pytest.approx(0.5)


def test_the_bundled_model_plays_a_multi_turn_entry_end_to_end(tmp_path):
    """The CI smoke (seconds): the bundled model (2,048 tokens of context) on a held-out
    entry whose tools are cut to those its ground truth calls, so that the prompt fits:
    sampling, the backends, the per-turn checks and BFCL's entry checker all run."""
    entry = load_multi_turn_entries(["multi_turn_base"], "held_out")[0]
    used = {ground_truth_call(entry, call).name for turn in entry.ground_truth for call in turn}
    small = dataclasses.replace(
        entry, functions=tuple(f for f in entry.functions if f["name"] in used)
    )
    envs: list[BFCLMultiTurnEnv] = []

    def env_factory(task: Task) -> BFCLMultiTurnEnv:
        envs.append(BFCLMultiTurnEnv(reward="turns", max_steps_per_turn=2))
        return envs[-1]

    result = evaluate(
        BUNDLED_MODEL_ID, [small.to_task()], env_factory, 2, max_turns=6,
        max_tokens_per_turn=24, max_model_length=2048, runs_dir=tmp_path,
    )  # fmt: skip
    (group,) = result.groups
    assert len(group.episodes) == 2 and all(env.entry is not None for env in envs)
    for episode in group.episodes:
        assert episode.num_turns >= 1 and episode.env_error is None
        # a first reply the codec cannot parse ends the episode before any env step
        valid = episode.metrics.get("bfcl_mt_turns_valid", 0.0)
        assert episode.metrics.get("bfcl_mt_turns", len(entry.turns)) == len(entry.turns)
        assert sum(episode.turn_rewards) == pytest.approx(valid / len(entry.turns))
    assert not leftover_instances()


def test_eval_cli_scores_bfcl_multi_turn_with_per_turn_rows(capsys):
    """An endpoint that answers every request in prose ends every user turn with no call:
    each turn is played (one request a turn) and fails, and the table says so per turn."""
    from test_serve_common import Scripted, ScriptedEndpoint, completion_json

    from post_training_cookbook.cli import main

    endpoint = ScriptedEndpoint([Scripted(body=completion_json("I would rather not."))])
    try:
        arguments = [
            "eval", "hosted:m", "--base-url", endpoint.base_url, "--no-api-key",
            "--benchmark", "bfcl_multi_turn:base@held_out", "--limit", "2", "--no-save",
        ]  # fmt: skip
        assert main(arguments) == 0
        table = capsys.readouterr().out
        entries = load_multi_turn_entries(["multi_turn_base"], "held_out")[:2]
        assert len(endpoint.requests) == sum(len(entry.turns) for entry in entries)
        sent = [request["tools"] for request in endpoint.requests]
        assert all(tools in [entry.tool_specs for entry in entries] for tools in sent)
    finally:
        endpoint.stop()
    assert re.search(r"bfcl multi_turn_base\s+0\.000", table)
    assert re.search(r"bfcl multi_turn_base prefix turns\s+0\.000", table)
    assert re.search(r"bfcl multi_turn_base turns \(ours\)\s+0\.000", table)
    assert main(["eval", "--benchmark", "bfcl_multi_turn:nope"]) == 2
    assert "unknown BFCL multi-turn categories" in capsys.readouterr().err


def _multi_turn_recipe():
    import importlib.util
    import sys

    folder = Path(__file__).parent.parent / "recipes" / "bfcl"
    spec = importlib.util.spec_from_file_location(
        "bfcl_multi_turn_recipe", folder / "multi_turn.py"
    )
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(recipe)
    finally:
        sys.path[:] = saved
    return recipe


def test_the_recipe_scores_every_model_it_makes_on_held_out_entries_only():
    """The real recipe (hours on 2 cores): every stage has a function, each model is scored
    after it is made, evaluation reads the held-out side, training the train side."""
    import inspect

    recipe = _multi_turn_recipe()
    stages = list(recipe.STAGE_FUNCTIONS)
    variants = [f"eval_{{}}_{v}" for v in ("miss_param", "miss_func", "long_context")]
    for model in ("sft", "grpo"):
        for scored in (f"eval_{model}", f"bfcl_{model}", *(v.format(model) for v in variants)):
            assert stages.index(scored) > stages.index(model)
    assert stages.index("eval_base") < stages.index("sft")
    for name in ("eval_base", "eval_sft", "eval_grpo"):
        assert '"held_out"' in inspect.getsource(recipe.STAGE_FUNCTIONS[name])
    for model in ("sft", "grpo"):
        for variant in variants:
            assert recipe.STAGE_FUNCTIONS[variant.format(model)].func is recipe.eval_variant
    assert '"held_out"' in inspect.getsource(recipe.eval_variant)
    grpo = inspect.getsource(recipe.grpo)
    assert 'entries("train")' in grpo and 'turn_rewards="per_step"' in grpo
    assert "max_sampling_attempts=" in grpo


def test_the_paired_gain_clusters_a_scenarios_variants_together():
    """One scenario's variants in several categories pass or fail together: counted as one
    cluster their standard error is larger than as independent entries, the gain the same."""
    recipe = _multi_turn_recipe()

    def scores(valid: dict[str, int]) -> dict:
        return {"per_entry": {i: {"turns": 4, "turns_valid": v} for i, v in valid.items()}}

    before = scores({f"multi_turn_{c}_{n}": 0 for c in ("base", "miss_func") for n in (3, 7, 9)})
    after = scores({"multi_turn_base_3": 4, "multi_turn_miss_func_3": 4} | {
        f"multi_turn_{c}_{n}": 0 for c in ("base", "miss_func") for n in (7, 9)
    })  # fmt: skip
    by_entry = recipe.paired_turn_gain(before, after)
    by_scenario = recipe.paired_turn_gain(before, after, by_scenario=True)
    assert by_entry["gain"] == by_scenario["gain"] == pytest.approx(8 / 24)
    assert (by_entry["clusters"], by_scenario["clusters"]) == (6, 3)
    assert by_scenario["se"] > by_entry["se"] > 0


def _write_scores(folder: Path, stage: str, category: str, valid: dict[int, int]) -> None:
    """A stage's JSON as ``_multi_turn`` writes it: per entry of ``category``, 4 turns and
    ``valid`` of them passing."""
    entries = {f"multi_turn_{category}_{n}": {"turns": 4, "turns_valid": v} for n, v in
               valid.items()}  # fmt: skip
    (folder / f"{stage}.json").write_text(json.dumps({"per_entry": entries}))


def test_the_report_adds_each_variant_category_scored_with_both_models(tmp_path):
    """A run stopped among the variant stages keeps what it scored: the report compares each
    variant scored with SFT and GRPO, and the wide gain pools them with ``multi_turn_base``,
    a scenario's variants as one cluster; a variant scored with one model only is left out."""
    recipe = _multi_turn_recipe()

    write = functools.partial(_write_scores, tmp_path)

    write("eval_base", "base", {3: 0, 7: 0})
    write("eval_sft", "base", {3: 0, 7: 1})
    write("eval_grpo", "base", {3: 2, 7: 1})
    write("eval_sft_miss_param", "miss_param", {3: 0, 7: 0})
    write("eval_grpo_miss_param", "miss_param", {3: 4, 7: 0})
    write("eval_sft_miss_func", "miss_func", {3: 0, 7: 0})  # GRPO not scored on it yet
    report = recipe.report(tmp_path)
    assert report["grpo_over_sft"]["gain"] == pytest.approx(2 / 8)
    assert report["grpo_over_sft_miss_param"]["gain"] == pytest.approx(4 / 8)
    assert "grpo_over_sft_miss_func" not in report
    wide = report["grpo_over_sft_wide"]
    assert wide["categories"] == ["base", "miss_param"]
    assert (wide["entries"], wide["clusters"], wide["gain"]) == (4, 2, pytest.approx(6 / 16))


def test_the_longer_stages_score_held_out_entries_past_the_first_bound_and_pool_with_it(tmp_path):
    """The ``*_longer`` stages score the held-out entries between the two prompt bounds with
    both models, after both are made; the report pools them with the first bound's entries (a
    category only where both models were scored at both bounds), scenarios as clusters."""
    recipe = _multi_turn_recipe()
    stages = list(recipe.STAGE_FUNCTIONS)
    for variant in ("", "_miss_param", "_miss_func", "_long_context"):
        for model in ("sft", "grpo"):
            stage = recipe.STAGE_FUNCTIONS[f"eval_{model}_longer{variant}"]
            assert stage.func is recipe.eval_variant and stage.keywords["longer"] is True
            assert stages.index(f"eval_{model}_longer{variant}") > stages.index("grpo")
    assert recipe.MAX_PROMPT_TOKENS < recipe.LONGER_PROMPT_TOKENS < recipe.EVAL["max_model_length"]

    write = functools.partial(_write_scores, tmp_path)

    write("eval_base", "base", {3: 0, 7: 0})
    write("eval_sft", "base", {3: 0, 7: 0})
    write("eval_grpo", "base", {3: 4, 7: 0})
    write("eval_sft_longer", "base", {17: 0})
    write("eval_grpo_longer", "base", {17: 2})
    for stage, valid in (("sft", {3: 0}), ("grpo", {3: 4})):
        write(f"eval_{stage}_miss_param", "miss_param", valid)
        write(f"eval_{stage}_longer_miss_param", "miss_param", {17: 0})
        write(f"eval_{stage}_miss_func", "miss_func", valid)  # no longer stages yet
    report = recipe.report(tmp_path)
    assert report["grpo_over_sft_wide"]["clusters"] == 2  # the first bound's, as before
    base = report["grpo_over_sft_to6000"]
    assert (base["entries"], base["gain"]) == (3, pytest.approx(6 / 12))
    wide = report["grpo_over_sft_to6000_wide"]
    assert wide["categories"] == ["base", "miss_param"]
    assert (wide["entries"], wide["clusters"], wide["gain"]) == (5, 3, pytest.approx(10 / 20))
    (tmp_path / "eval_grpo_longer.json").unlink()
    assert not any("to6000" in key for key in recipe.report(tmp_path))


def test_the_paired_bfcl_change_compares_the_same_items_from_the_stage_json():
    """BFCL single-turn before/after: each item's verdict is kept in the stage's JSON (the
    eval folder is not carried across machines); only items scored in both count."""
    recipe = _multi_turn_recipe()
    before = {"per_item": {"simple_0": 1, "simple_1": 1, "multiple_0": 0, "only_before": 1}}
    after = {"per_item": {"simple_0": 1, "simple_1": 0, "multiple_0": 0}, "eval_dir": "/gone"}
    change = recipe.paired_bfcl_change(before, after)
    assert change["items"] == 3
    assert change["change"] == pytest.approx(-1 / 3)
    assert change["se"] > 0 and change["change_in_se"] < 0


def test_the_grpo_stages_score_the_checkpoint_of_their_step_count(tmp_path, monkeypatch):
    """``carry.py restore`` rebuilds a GRPO run folder with checkpoints only, and ``--steps
    N`` continues a run past the 12 steps whose scores are kept: the stages that score the
    GRPO model take the checkpoint of ``GRPO_STEPS``, never a later one."""
    recipe = _multi_turn_recipe()
    run = tmp_path / recipe.GRPO_RUN
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 12"):
        recipe.grpo_model(tmp_path)
    (run / "final_model").mkdir(parents=True)
    assert recipe.grpo_model(tmp_path) == (str(run), None)  # a run without checkpoints
    for step in (9, 12, 18):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    assert recipe.grpo_model(tmp_path) == (str(run), 12)
    monkeypatch.setattr(recipe, "GRPO_STEPS", 18)
    assert recipe.grpo_model(tmp_path) == (str(run), 18)
    monkeypatch.setattr(recipe, "GRPO_STEPS", 24)
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 24"):
        recipe.grpo_model(tmp_path)


def test_a_longer_grpo_run_keeps_the_12_step_runs_stage_names(monkeypatch):
    """``--steps 18`` continues the same run folder; its stages are named apart, so the
    12-step run's scores and report stay."""
    import inspect
    import sys

    monkeypatch.setattr(sys, "argv", ["multi_turn.py", "--steps", "18"])
    recipe = _multi_turn_recipe()
    assert (recipe.GRPO_RUN, recipe.GRPO_STAGE, recipe.GRPO_STEPS) == ("grpo", "grpo_18steps", 18)
    stages = set(recipe.STAGE_FUNCTIONS)
    assert {"grpo_18steps", "eval_grpo_18steps", "eval_grpo_18steps_miss_param"} <= stages
    assert {"bfcl_grpo_18steps", "report_grpo_18steps", "plots_grpo_18steps"} <= stages
    assert not stages & {"grpo", "eval_grpo", "report", "eval_grpo_miss_param"}
    assert "num_steps=GRPO_STEPS" in inspect.getsource(recipe.grpo)


def test_the_calls_reward_names_its_stages_apart_and_reaches_the_env(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["multi_turn.py", "--steps", "24", "--reward", "calls"])
    recipe = _multi_turn_recipe()
    assert (recipe.GRPO_RUN, recipe.GRPO_STAGE) == ("grpo", "grpo_24steps_calls")
    assert {"grpo_24steps_calls", "eval_grpo_24steps_calls_miss_func"} <= set(
        recipe.STAGE_FUNCTIONS
    )
    assert recipe.env_factory(None).reward == "calls"
    monkeypatch.setattr(sys, "argv", ["multi_turn.py", "--reward", "entry"])
    with pytest.raises(SystemExit, match="--reward must be turns or calls"):
        _multi_turn_recipe()


def test_demonstrations_of_the_ground_truth_carry_each_entrys_tools(tmp_path):
    """The env's tools depend on the entry, so they are read after a reset: an SFT
    conversation without them would teach calls to tools its prompt never shows."""
    from post_training_cookbook.sft.conversations import read_conversations
    from post_training_cookbook.sft.demonstrations import collect_demonstrations

    entries = load_multi_turn_entries(["multi_turn_base"], "train")[:2]
    result = collect_demonstrations(
        GroundTruthPlayer(entries), lambda task: BFCLMultiTurnEnv(),
        [entry.to_task() for entry in entries], output=tmp_path / "demos.jsonl",
        max_turns=40, max_model_length=8192,
    )  # fmt: skip
    assert len(result.conversations) == 2
    written = read_conversations(tmp_path / "demos.jsonl")
    for entry, conversation in zip(entries, written, strict=True):
        assert conversation.tools == entry.tool_specs
    assert not leftover_instances()
