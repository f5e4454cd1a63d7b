"""BFCL on ``bfcl-eval``'s data and checker: our verdicts are bfcl-eval's own runner's on its
own (question, possible answer) pairs, train and test share no question, and ``evaluate``
scores a local model and an OpenAI-compatible endpoint with BFCL's per-category report."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from test_serve_common import Scripted, ScriptedEndpoint, completion_json

from post_training_cookbook.bundled_envs.bfcl import (
    CATEGORIES,
    NO_ANSWER_CATEGORIES,
    TEST_CATEGORIES,
    TRAIN_CATEGORIES,
    BFCLEnv,
    BFCLItem,
    bfcl_tasks,
    bfcl_train_tasks,
    check_reply,
    load_items,
    question_texts,
)
from post_training_cookbook.cli import main
from post_training_cookbook.envs import Task
from post_training_cookbook.evaluation import HostedModel, evaluate
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.rollout import TruncationCause

# bfcl-eval's own registry entry for an OpenAI function-calling model: its checker path is
# the one a leaderboard submission of such a model takes.
OPENAI_FC_REGISTRY_NAME = "gpt-4o-2024-11-20-FC"


@pytest.fixture(scope="module")
def items_by_category() -> dict[str, list[BFCLItem]]:
    items = load_items(CATEGORIES, limit=4)
    return {c: [item for item in items if item.category == c] for c in CATEGORIES}


@pytest.fixture(scope="module")
def bfcl_handler():
    """bfcl-eval's OpenAI completions handler in FC mode: its ``decode_ast`` is what BFCL's
    runner decodes an FC reply with. Built with a placeholder key; it sends nothing."""
    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENAI_API_KEY", "unused-no-request-is-made")
        return OpenAICompletionsHandler("gpt-4o-2024-11-20", 0.001, OPENAI_FC_REGISTRY_NAME, True)


def tool_name(name: str) -> str:
    return name.replace(".", "_")  # what convert_to_tool sends an OpenAI-style model


def right_calls(item: BFCLItem) -> list[dict[str, str]]:
    """Each expected call with the first allowed value of every parameter given one."""
    assert item.possible_answer is not None
    calls = []
    for expected in item.possible_answer:
        ((name, parameters),) = expected.items()
        arguments = first_allowed(parameters)
        calls.append({"name": tool_name(name), "arguments": json.dumps(arguments)})
    return calls


def first_allowed(options_by_key: dict[str, list[Any]]) -> dict[str, Any]:
    """The first allowed value of each given key; nested dicts hold options in turn."""

    def value(option: Any) -> Any:
        if isinstance(option, dict):
            return first_allowed(option)
        if isinstance(option, list) and option and all(isinstance(o, dict) for o in option):
            return [first_allowed(o) for o in option]
        return option

    return {key: value(options[0]) for key, options in options_by_key.items() if options[0] != ""}


def wrong_replies(item: BFCLItem) -> dict[str, list[dict[str, str]]]:
    """Replies BFCL must reject, each a different way of being wrong."""
    right = right_calls(item)
    first_arguments = json.loads(right[0]["arguments"])
    key = next(iter(first_arguments))
    value = first_arguments[key]
    changed = value + 1000 if isinstance(value, int | float) else f"{value} (not it)"
    wrong_value = {**right[0], "arguments": json.dumps({**first_arguments, key: changed})}
    replies = {
        "no call": [],
        "wrong value": [wrong_value, *right[1:]],
        "wrong name": [{**right[0], "name": "no_such_function"}, *right[1:]],
        "arguments not JSON": [{**right[0], "arguments": "{base: 10"}, *right[1:]],
    }
    if len(right) > 1:
        replies["one call short"] = right[:-1]
    else:
        replies["one call too many"] = right * 2
    return replies


def bfcl_runner_verdict(handler: Any, item: BFCLItem, calls: list[dict[str, str]]) -> bool:
    """What bfcl-eval's eval_runner says of this reply, recorded as its FC handler records
    one: ``[{name: arguments JSON}]``, or the reply's text when it calls nothing."""
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.eval_checker import eval_runner

    result: Any = [{c["name"]: c["arguments"]} for c in calls] if calls else "I cannot help."
    prompt = {"id": item.id, "question": [list(item.messages)], "function": list(item.functions)}
    if item.category in NO_ANSWER_CATEGORIES:
        verdict = eval_runner._evaluate_single_relevance_entry(
            handler, item.id, result, prompt, OPENAI_FC_REGISTRY_NAME, item.category
        )
    else:
        verdict = eval_runner._evaluate_single_ast_entry(
            handler, item.id, result, list(item.possible_answer or ()), prompt,
            OPENAI_FC_REGISTRY_NAME, item.category, Language.PYTHON, ReturnFormat.PYTHON,
        )  # fmt: skip
    return bool(verdict["valid"])


@pytest.mark.parametrize("category", [c for c in CATEGORIES if c not in NO_ANSWER_CATEGORIES])
def test_verdicts_on_bfcls_own_pairs_equal_bfcl_evals_runner(
    category, items_by_category, bfcl_handler
):
    for item in items_by_category[category]:
        right = right_calls(item)
        assert check_reply(item, right).valid
        assert bfcl_runner_verdict(bfcl_handler, item, right)
        for how, calls in wrong_replies(item).items():
            ours = check_reply(item, calls)
            assert not ours.valid, (item.id, how)
            assert ours.error_type, (item.id, how)
            assert not bfcl_runner_verdict(bfcl_handler, item, calls), (item.id, how)


@pytest.mark.parametrize("category", NO_ANSWER_CATEGORIES)
def test_relevance_verdicts_equal_bfcl_evals_runner(category, items_by_category, bfcl_handler):
    for item in items_by_category[category]:
        function = item.functions[0]
        required = function["parameters"].get("required", [])
        call = {
            "name": tool_name(function["name"]),
            "arguments": json.dumps(dict.fromkeys(required, 1)),
        }
        broken = {**call, "arguments": "not json"}
        for calls in ([], [call], [broken]):
            ours = check_reply(item, calls).valid
            assert ours == bfcl_runner_verdict(bfcl_handler, item, calls), (item.id, calls)
        assert check_reply(item, [call]).valid is (category == "live_relevance")


def test_train_and_test_share_no_question():
    test, train = bfcl_tasks(), bfcl_train_tasks()
    assert {BFCLItem.from_task(t).category for t in test} == set(TEST_CATEGORIES)
    assert {BFCLItem.from_task(t).category for t in train} == set(TRAIN_CATEGORIES)
    test_items = [BFCLItem.from_task(task) for task in test]
    train_items = [BFCLItem.from_task(task) for task in train]
    assert not {i.id for i in test_items} & {i.id for i in train_items}
    test_texts = set().union(*(question_texts(item) for item in test_items))
    assert not any(question_texts(item) & test_texts for item in train_items)
    # the rule has work to do: BFCL's live set repeats a few test questions, which are left out
    all_live = load_items(TRAIN_CATEGORIES)
    left_out = [item for item in all_live if question_texts(item) & test_texts]
    assert left_out and len(train) == len(all_live) - len(left_out)


def test_bfcl_env_rewards_the_checkers_verdict_and_sends_bfcls_tool_docs():
    (task,) = bfcl_tasks(["simple_python"], limit=1)
    item = BFCLItem.from_task(task)

    async def play(calls: list[dict[str, str]]) -> tuple[float, list[Any]]:
        env = BFCLEnv()
        messages = await env.reset(task)
        assert messages == [{"role": "user", "content": item.messages[0]["content"]}]
        reply: dict[str, Any] = {"role": "assistant", "content": ""}
        if calls:
            reply["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": call}
                for i, call in enumerate(calls)
            ]
        result = await env.step(reply)  # type: ignore[arg-type]
        assert result.terminated and result.metrics["bfcl_valid"] == result.reward
        return result.reward, env.tool_specs

    reward, tools = asyncio.run(play(right_calls(item)))
    assert reward == 1.0
    assert asyncio.run(play([]))[0] == 0.0
    # BFCL's conversion of its docs: "dict" is JSON schema's "object", its hint is added
    (tool,) = tools
    assert tool["function"]["name"] == "calculate_triangle_area"
    assert tool["function"]["parameters"]["type"] == "object"
    assert tool["function"]["description"].endswith("in Python 3 syntax.")


MALFORMED_CALLS: dict[str, Any] = {
    "tool_calls a number": 5,
    "a call a string": ["calculate_triangle_area(base=10)"],
    "a call without its function": [{"id": "c", "type": "function"}],
    "a name that is a list": [{"id": "c", "function": {"name": ["f"], "arguments": "{}"}}],
    "arguments an object, not its JSON": [
        {"id": "c", "function": {"name": "f", "arguments": {"base": 10}}}
    ],
    "arguments nested past the recursion limit": [
        {"id": "c", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}
    ],
    "arguments without a name": [{"id": "c", "function": {"arguments": "{}"}}],
}


@pytest.mark.parametrize("case", MALFORMED_CALLS)
def test_bfcl_env_scores_a_malformed_call_as_a_failed_call(case: str) -> None:
    """A hand-written client (not the codec) can send any of these: each is the reply's
    failure to decode, reward 0, never an exception out of ``step``."""
    (task,) = bfcl_tasks(["simple_python"], limit=1)

    async def play() -> Any:
        env = BFCLEnv()
        await env.reset(task)
        reply = {"role": "assistant", "content": "", "tool_calls": MALFORMED_CALLS[case]}
        return await env.step(reply), env.verdict  # type: ignore[arg-type]

    result, verdict = asyncio.run(play())
    assert result.terminated and result.reward == 0.0 and result.metrics["bfcl_valid"] == 0.0
    assert verdict.error_type == "ast_decoder:decoder_failed", verdict
    assert "malformed" in verdict.errors[0]


def test_bad_benchmark_input_fails_before_any_model_loads():
    with pytest.raises(ValueError, match="unknown benchmark"):
        evaluate("no/such-model", benchmark="bfcl2", runs_dir=None)
    with pytest.raises(ValueError, match="unknown BFCL categories"):
        evaluate("no/such-model", benchmark="bfcl:simple_java", runs_dir=None)
    with pytest.raises(ValueError, match="pass neither"):
        evaluate("no/such-model", [], lambda task: BFCLEnv(), benchmark="bfcl", runs_dir=None)
    with pytest.raises(ValueError, match="limit applies to a benchmark"):
        evaluate("no/such-model", [], lambda task: BFCLEnv(), limit=3, runs_dir=None)
    with pytest.raises(ValueError, match="live categories only"):
        bfcl_train_tasks(["simple_python"])


def test_the_bundled_model_on_five_bfcl_items(tmp_path):
    result = evaluate(
        BUNDLED_MODEL_ID, benchmark="bfcl", limit=1, max_tokens_per_turn=96, runs_dir=tmp_path
    )
    score = result.benchmark
    assert score is not None and result.settings.temperature == 0.0
    assert list(score.per_category) == list(TEST_CATEGORIES)
    assert all(category.total == 1 for category in score.per_category.values())
    assert score.overall == sum(score.accuracy.values()) / 5
    # each category's accuracy is the checker's verdict on that episode's reply
    for group in result.groups:
        item = BFCLItem.from_task(group.task)
        (episode,) = group.episodes
        if episode.truncation is None:
            (reply,) = [m for m in episode.messages if m["role"] == "assistant"]
            calls = [call["function"] for call in reply.get("tool_calls") or []]
            assert score.accuracy[item.category] == float(check_reply(item, calls).valid)
    summary = json.loads(next(tmp_path.glob("eval_*/summary.json")).read_text())
    assert summary["benchmark"]["accuracy"] == score.accuracy


@pytest.fixture
def scripted():
    endpoints: list[ScriptedEndpoint] = []

    def start(*script: Scripted) -> ScriptedEndpoint:
        endpoints.append(ScriptedEndpoint(list(script)))
        return endpoints[-1]

    yield start
    for endpoint in endpoints:
        endpoint.stop()


def triangle_call() -> dict[str, Any]:
    arguments = json.dumps({"base": 10, "height": 5})
    return completion_json(
        None,
        [{"id": "c1", "type": "function",
          "function": {"name": "calculate_triangle_area", "arguments": arguments}}],
    )  # fmt: skip


def test_an_endpoint_is_scored_on_bfcl_with_bfcls_tools(scripted):
    endpoint = scripted(Scripted(body=triangle_call()))
    hosted = HostedModel("m", endpoint.base_url, api_key_env=None)
    result = evaluate(hosted, benchmark="bfcl:simple_python,irrelevance", limit=1, runs_dir=None)
    assert result.benchmark is not None
    # the right call for simple_python_0; a call at all is wrong for an irrelevance question
    assert result.benchmark.accuracy == {"simple_python": 1.0, "irrelevance": 0.0}
    by_tool = {r["tools"][0]["function"]["name"]: r for r in endpoint.requests}
    simple, irrelevance = by_tool["calculate_triangle_area"], by_tool["determine_body_mass_index"]
    (item,) = load_items(["simple_python"], 1)
    assert simple["messages"] == [{"role": "user", "content": item.messages[0]["content"]}]
    assert simple["tools"] == item.tool_specs and simple["temperature"] == 0.0
    # BFCL's "float" is JSON schema's "number", marked as a float
    weight = irrelevance["tools"][0]["function"]["parameters"]["properties"]["weight"]
    assert weight["type"] == "number" and weight["format"] == "float"


def test_eval_cli_scores_bfcl_and_rejects_what_does_not_fit(scripted, capsys):
    endpoint = scripted(Scripted(body=completion_json("No function fits this question.")))
    arguments = [
        "eval", "hosted:m", "--base-url", endpoint.base_url, "--no-api-key",
        "--benchmark", "bfcl:irrelevance,multiple", "--limit", "2", "--no-save",
    ]  # fmt: skip
    assert main(arguments) == 0
    table = capsys.readouterr().out
    assert re.search(r"bfcl irrelevance\s+1\.000", table)
    assert re.search(r"bfcl multiple\s+0\.000", table)
    assert re.search(r"bfcl overall\s+0\.500", table)
    assert main([*arguments, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["benchmark"]["per_category"]["multiple"] == {
        "correct": 0,
        "total": 2,
    }
    assert main(["eval", "--benchmark", "bfcl", "--env", "x:y"]) == 2
    assert "drop --env" in capsys.readouterr().err
    assert main(["eval", "--limit", "3"]) == 2
    assert "limit applies to --benchmark" in capsys.readouterr().err
    assert main(["eval", "--benchmark", "bfcl:nope"]) == 2
    assert "unknown BFCL categories ['nope']" in capsys.readouterr().err


def test_live_tasks_train_a_grpo_step_rewarded_by_the_checker(tmp_path, monkeypatch):
    """GRPO on the live categories: a scripted policy answers each group once with the right
    call and once in text, so each group's rewards are BFCL's verdicts on both replies."""
    from test_grpo_common import quick_config, step_metrics, train_dump
    from transformers import AutoTokenizer

    from post_training_cookbook.engine.types import PolicySegment, SampledSequence
    from post_training_cookbook.grpo.train import train_multi_turn
    from post_training_cookbook.models.catalog import resolve_model
    from post_training_cookbook.service.local import LocalModelService

    tasks = bfcl_train_tasks(["live_simple", "live_irrelevance"], limit=1)
    simple = BFCLItem.from_task(tasks[0])
    (call,) = right_calls(simple)
    arguments = json.loads(call["arguments"])
    replies = [
        f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {json.dumps(arguments)}}}\n'
        "</tool_call><|im_end|>",
        "No function call is needed.<|im_end|>",
    ]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(BUNDLED_MODEL_ID).source)

    seen: dict[tuple[int, ...], int] = {}  # per prompt (one per task): call, text, call...

    def next_reply(prompt_tokens: list[int]) -> list[int]:
        count = seen[tuple(prompt_tokens)] = seen.get(tuple(prompt_tokens), -1) + 1
        return tokenizer.encode(replies[count % 2], add_special_tokens=False)

    async def sample(service, prompt_tokens, n, params):
        version = service.policy_state().applied_weights_version
        encoded = [next_reply(prompt_tokens) for _ in range(n)]
        return [
            SampledSequence(t, [-1.0] * len(t), "stop", [PolicySegment(0, version)])
            for t in encoded
        ]

    monkeypatch.setattr(LocalModelService, "sample", sample)
    config = quick_config(BUNDLED_MODEL_ID, tmp_path, batch_size=2, max_turns=1,
                          max_model_length=2048)  # fmt: skip
    run = train_multi_turn(config, tasks, lambda task: BFCLEnv())
    (metrics,) = step_metrics(run.path).values()
    assert metrics["train/samples"] == 4  # both groups had reward variance and trained
    assert metrics["rollout/env/bfcl_live_simple_valid"] == 0.5
    assert metrics["rollout/env/bfcl_live_irrelevance_valid"] == 0.5
    for record in train_dump(run.path, 0):
        item = BFCLItem.from_task(Task(**record["task"]))
        reply = record["messages"][-1]
        calls = [c["function"] for c in reply.get("tool_calls") or []]
        assert record["reward"] == float(check_reply(item, calls).valid)
        assert (record["reward"] == 1.0) is (bool(calls) == (item.category == "live_simple"))


@pytest.mark.heavy
def test_our_server_as_an_endpoint_scores_on_bfcl_what_the_local_model_scores():
    from post_training_cookbook.serve import start_server

    options = {"benchmark": "bfcl", "limit": 2, "max_tokens_per_turn": 96, "runs_dir": None}
    local = evaluate(BUNDLED_MODEL_ID, **options)
    with start_server(BUNDLED_MODEL_ID) as server:
        hosted = evaluate(
            HostedModel("tool-use-tiny", server.base_url, api_key_env=None), **options
        )
    assert local.benchmark is not None and hosted.benchmark is not None
    assert hosted.benchmark.per_category == local.benchmark.per_category
    # rewards too, but where the codec could not parse the local reply: the server answers
    # that text as a plain reply, which BFCL (and so the benchmark report) reads as no call
    parse_failures = 0
    for local_group, hosted_group in zip(local.groups, hosted.groups, strict=True):
        (local_episode,), (hosted_episode,) = local_group.episodes, hosted_group.episodes
        if local_episode.truncation is TruncationCause.PARSE_FAILURE:
            parse_failures += 1
            item = BFCLItem.from_task(local_group.task)
            assert hosted_episode.reward == float(check_reply(item, []).valid)
        else:
            assert hosted_episode.reward == local_episode.reward
    assert 0 < parse_failures < len(local.groups)  # both kinds were compared
