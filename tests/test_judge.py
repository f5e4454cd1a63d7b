"""Judge rewards against an OpenAI-compatible endpoint on loopback (``judge_server.py``, a
fixture answering fixed completions): scores, rubrics, the cache, concurrency, timeouts,
retries, malformed scores, refusals, and judge failures under the env error policy."""

from __future__ import annotations

import asyncio
import runpy
import sys
import time

import pytest
from judge_server import JudgeServer, serving
from test_rollout import CODEC, PARAMS, ScriptedSampler, sampled_tokens

from post_training_cookbook.envs import Rubric, Task, ToolEnv, numeric_answer
from post_training_cookbook.envs.judge import (
    JudgeCache,
    JudgeError,
    JudgeReward,
    MalformedScore,
    OpenAIJudge,
    parse_score,
)
from post_training_cookbook.evaluation import LocalJudge
from post_training_cookbook.rollout import (
    EnvStepError,
    EpisodeLimits,
    EpisodeRunner,
    TruncationCause,
    run_episode,
)
from post_training_cookbook.types import Message

TASK = Task("Plan a picnic for four.", "bread, fruit, blanket")
KEY_ENV = "COOKBOOK_TEST_JUDGE_KEY"


@pytest.fixture
def server():
    return JudgeServer(slow_s=0.5)


@pytest.fixture
def url(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-loopback-only")
    with serving(server) as base_url:
        yield base_url


def judge_reward(url: str, **options) -> JudgeReward:
    judge = OpenAIJudge("judge-model", base_url=url, api_key_env=KEY_ENV)
    return JudgeReward(judge, rubric="Is the plan complete?", backoff_s=0.0, **options)


def reply(content: str) -> Message:
    return Message(role="assistant", content=content)


def test_the_judges_score_is_the_reward_and_the_request_holds_rubric_task_and_answer(server, url):
    reward = judge_reward(url)
    assert asyncio.run(reward(reply("Bread and fruit, worth 7."), TASK)) == 0.7
    (request,) = server.requests
    assert request["authorization"] == "Bearer sk-loopback-only"  # the key from the environment
    body = request["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    system, user = body["messages"]
    assert "Score: N" in system["content"] and "0 (fails the rubric) to 10" in system["content"]
    for part in ("Is the plan complete?", TASK.prompt, TASK.target, "worth 7"):
        assert part in user["content"]


def test_a_rubric_weighs_the_judge_beside_an_exact_check_and_reports_both(url):
    rubric = Rubric([numeric_answer, judge_reward(url, name="style")], weights=[1.0, 0.5])
    task = Task("What is 6 * 7?", "42")

    async def episode():
        env = ToolEnv([], reward_fn=rubric)
        await env.reset(task)
        return await env.step(reply("42"))

    final = asyncio.run(episode())
    assert final.reward == pytest.approx(1.0 + 0.5 * 0.5)
    assert final.metrics["rubric/numeric_answer"] == 1.0
    assert final.metrics["rubric/style"] == 0.5


def test_the_cache_answers_a_repeated_judgement_and_shares_one_request_in_flight(server, url):
    reward = judge_reward(url)

    async def judged():
        same = await asyncio.gather(*(reward(reply("worth 3"), TASK) for _ in range(5)))
        again = await reward(reply("worth 3"), TASK)
        other_task = await reward(reply("worth 3"), Task("Another question.", "x"))
        return same, again, other_task

    same, again, other_task = asyncio.run(judged())
    assert same == [0.3] * 5 and again == 0.3 and other_task == 0.3
    assert len(server.requests) == 2  # one per (answer, task)
    assert reward.stats.cache_hits == 5 and reward.stats.requests == 2
    uncached = judge_reward(url, cache=None)
    asyncio.run(uncached.score_many([(reply("worth 3"), TASK)] * 2))
    assert len(server.requests) == 4


def test_judgements_run_concurrently_up_to_max_concurrency(server, url):
    items = [(reply(f"SLOW worth {i}"), TASK) for i in range(8)]
    scores = asyncio.run(judge_reward(url, max_concurrency=8).score_many(items))
    assert scores == [i / 10 for i in range(8)]  # in the order asked
    assert server.max_in_flight > 2  # answered together (8 when the machine is idle)
    server.max_in_flight = 0
    started = time.perf_counter()
    asyncio.run(judge_reward(url, max_concurrency=2).score_many(items))
    assert server.max_in_flight == 2
    assert time.perf_counter() - started >= 4 * 0.5  # four waves of two slow answers


def test_a_judge_that_times_out_is_retried_then_fails_with_a_judge_error(server, url):
    reward = judge_reward(url, timeout_s=0.1, max_attempts=2)
    with pytest.raises(JudgeError, match=r"no score after 2 attempt\(s\): timed out after 0.1s"):
        asyncio.run(reward(reply("SLOW"), TASK))
    assert (reward.stats.requests, reward.stats.retries, reward.stats.failures) == (2, 1, 1)


@pytest.mark.parametrize(
    ("answer", "problem"),
    [("GARBLED", "no 'Score: N' in the judge's reply"), ("HUGE", "score 42 is outside 0-10")],
)
def test_a_malformed_score_is_retried_then_fails_and_is_never_cached(server, url, answer, problem):
    reward = judge_reward(url, max_attempts=3)
    for _ in range(2):
        with pytest.raises(JudgeError, match=problem):
            asyncio.run(reward(reply(answer), TASK))
    assert len(server.requests) == 6 and len(reward.cache or JudgeCache()) == 0


def test_a_server_error_is_retried_and_a_refusal_is_not(server, url):
    reward = judge_reward(url)
    assert asyncio.run(reward(reply("FLAKY worth 9"), TASK)) == 0.9
    assert reward.stats.retries == 1
    with pytest.raises(JudgeError, match="answered HTTP 401: Incorrect API key"):
        asyncio.run(reward(reply("REFUSE"), TASK))
    assert len(server.requests) == 3  # the refusal was asked once


def test_a_missing_api_key_fails_before_any_request(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{KEY_ENV} holds no API key"):
        OpenAIJudge("judge-model", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV)


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("Good.\nScore: 8", 0.8),
        ("score = 2.5", 0.25),
        ("Score: 3 ... on reflection, Score: 6", 0.6),
        ("**Score:** 10", 1.0),
        ("Score: 4/5", 0.8),
        ("7", 0.7),
        ("Score: 0", 0.0),
    ],
)
def test_parse_score_reads_the_last_score_line(text, reward):
    assert parse_score(text, 10) == pytest.approx(reward)


@pytest.mark.parametrize("text", ["no number", "Score: -1", "Score: 11", "Score: 3/0", ""])
def test_parse_score_refuses_what_is_no_score_in_range(text):
    with pytest.raises(MalformedScore):
        parse_score(text, 10)


# ---------------------------------------------------------------- under the env error policy


def play_judged(url: str, answer: str, **limits_options):
    reward = judge_reward(url, max_attempts=1)
    limits = EpisodeLimits(
        max_turns=2, max_model_length=512, max_tokens_per_turn=64, **limits_options
    )
    tokens = sampled_tokens(reply(answer))
    sampler = ScriptedSampler([tokens] * 4)
    runner = EpisodeRunner(lambda task: ToolEnv([], reward_fn=reward), sampler, CODEC, limits)
    return asyncio.run(run_episode(TASK, runner, PARAMS, seed=1))


def test_a_judge_failure_is_an_env_error_under_each_policy(url):
    judged = play_judged(url, "worth 8", env_errors="raise")
    assert judged.terminated and judged.reward == 0.8
    with pytest.raises(EnvStepError, match="JudgeError"):
        play_judged(url, "GARBLED", env_errors="raise")
    truncated = play_judged(url, "GARBLED", env_errors="truncate")
    assert truncated.truncation is TruncationCause.ENV and truncated.reward == 0.0
    assert "no 'Score: N'" in (truncated.env_error or "")
    replayed = play_judged(url, "FLAKY worth 6", env_errors="retry")
    assert replayed.reward == 0.6 and replayed.env_retries == 1  # a fresh env, asked again


# ---------------------------------------------------------------- a local judge


def test_a_local_judge_answers_through_our_engine_and_its_reply_is_parsed_as_any_judges():
    from post_training_cookbook.models import BUNDLED_MODEL_ID

    judge = LocalJudge(BUNDLED_MODEL_ID, max_batch_size=4)
    # the bundled model is no grader: it answers questions of its game with a number
    question = [Message(role="user", content="What is the weight of kalo? Reply 7.")]

    def ask_the_question(rubric: str, answer: str, task: Task, max_score: float):
        return question

    reward = JudgeReward(judge, "unused", build_messages=ask_the_question, max_score=100)

    async def judged():
        replies = await asyncio.gather(
            *(judge.complete(question, max_tokens=8, temperature=0.0) for _ in range(3))
        )
        score = await reward(reply("anything"), TASK)
        await judge.close()
        return replies, score

    replies, score = asyncio.run(judged())
    assert len(set(replies)) == 1  # greedy, batched together: the same reply
    assert score == parse_score(replies[0], 100)


def test_the_tutorials_judge_block_runs_against_the_endpoint_the_environment_names(
    server, tmp_path, monkeypatch, capsys
):
    from test_eval_tutorial import code_blocks

    env_file = code_blocks("python")[0]
    (judged,) = code_blocks("python", marked=True)
    (tmp_path / "calculator_env.py").write_text(env_file)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "calculator_env", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-loopback-only")
    with serving(server) as base_url:
        monkeypatch.setenv("OPENAI_BASE_URL", base_url)
        namespace = runpy.run_path(_write(tmp_path / "judged.py", judged), run_name="__main__")
    monkeypatch.delitem(sys.modules, "calculator_env", raising=False)
    assert server.requests and all(r["body"]["model"] == "gpt-4.1-mini" for r in server.requests)
    assert namespace["judge"].stats.requests == len(server.requests)
    assert "check_env: 0 errors" in capsys.readouterr().out


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)
