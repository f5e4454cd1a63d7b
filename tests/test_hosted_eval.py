"""``evaluate`` on an OpenAI-compatible endpoint: our own server as the "hosted" model scores what
the local evaluation scores, and the client's rules for retries, timeouts and refusals hold
against a scripted endpoint on loopback."""

from __future__ import annotations

import asyncio

import pytest
from test_serve_common import Scripted, ScriptedEndpoint, completion_json, error_json

from post_training_cookbook.cli import main
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
from post_training_cookbook.evaluation import HostedEndpointError, HostedModel, evaluate
from post_training_cookbook.evaluation.hosted import OpenAIChatSampler
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.rollout import TruncationCause
from post_training_cookbook.serve import start_server

TASKS = list(TOOL_USE_GAME_VAL_TASKS[:16])


@pytest.fixture(scope="module")
def tiny_server():
    with start_server(BUNDLED_MODEL_ID) as server:
        yield server


def test_our_server_as_a_hosted_model_scores_what_the_local_model_scores(tiny_server):
    options = {"temperature": 0.0, "runs_dir": None}
    local = evaluate(BUNDLED_MODEL_ID, TASKS, lambda task: ToolUseGameEnv(), 1, **options)
    hosted_model = HostedModel("tool-use-tiny", tiny_server.base_url, api_key_env=None)
    hosted = evaluate(hosted_model, TASKS, lambda task: ToolUseGameEnv(), 1, **options)
    assert [t.rewards for t in hosted.per_task] == [t.rewards for t in local.per_task]
    assert 0 < local.reward_mean < 1  # the comparison means something
    # token-in-token-out on the server: the conversations it held are the local episodes'
    for local_group, hosted_group in zip(local.groups, hosted.groups, strict=True):
        (local_episode,), (hosted_episode,) = local_group.episodes, hosted_group.episodes
        assert hosted_episode.num_turns == local_episode.num_turns
        assert hosted_episode.tokens == []
        if local_episode.truncation is None:
            assert hosted_episode.endpoint_usage.context_tokens == len(local_episode.tokens)
    assert "eval/tokens_per_episode" not in hosted.metrics
    assert hosted.metrics["eval/endpoint_tokens_per_episode"] > 0
    assert hosted.hosted and not local.hosted


def test_eval_compares_a_hosted_and_a_local_model_with_the_token_caveat(tiny_server, capsys):
    arguments = [
        "eval", "--compare", "hosted:tool-use-tiny", BUNDLED_MODEL_ID,
        "--base-url", tiny_server.base_url, "--no-api-key", "--temperature", "0",
        "--num-tasks", "4", "--no-save",
    ]  # fmt: skip
    assert main(arguments) == 0
    table = capsys.readouterr().out
    assert "A: hosted-tool-use-tiny" in table and "endpoint tokens / episode" in table
    assert "reward (mean)" in table and "+0.000" in table.splitlines()[2]
    assert "A is a hosted model" in table


def test_a_hosted_model_without_its_api_key_fails_before_any_request(scripted, monkeypatch, capsys):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    endpoint = scripted(Scripted())
    hosted = HostedModel("m", endpoint.base_url, api_key_env="NO_SUCH_KEY")
    with pytest.raises(ValueError, match="NO_SUCH_KEY"):
        evaluate(hosted, TASKS[:1], lambda task: ToolUseGameEnv(), runs_dir=None)
    assert endpoint.requests == []
    assert main(["eval", "hosted:m"]) == 2
    assert "needs --base-url" in capsys.readouterr().err
    arguments = [
        "eval",
        "hosted:m",
        "--base-url",
        endpoint.base_url,
        "--api-key-env",
        "NO_SUCH_KEY",
    ]
    assert main(arguments) == 2
    assert "NO_SUCH_KEY" in capsys.readouterr().err


# ---------------------------------------------------------------- the client's rules


def chat(endpoint, *, retries=3, timeout_s=5.0, concurrency=8, calls=1, key_env=None):
    """``calls`` chats at once through ``OpenAIChatSampler``; returns (turns, sampler, waits)."""
    waits = []

    async def no_wait(seconds):
        waits.append(seconds)

    hosted = HostedModel(
        "m", endpoint.base_url, api_key_env=key_env, max_retries=retries,
        timeout_s=timeout_s, max_concurrency=concurrency,
    )  # fmt: skip
    sampler = OpenAIChatSampler(hosted, "a-key", sleep=no_wait)
    messages = [{"role": "user", "content": "q"}]

    async def run():
        try:
            return await asyncio.gather(
                *(sampler.chat(messages, [], SamplingParams(max_tokens=8)) for _ in range(calls))
            )
        finally:
            await sampler.close()

    return asyncio.run(run()), sampler, waits


@pytest.fixture
def scripted():
    endpoints = []

    def start(*script):
        endpoints.append(ScriptedEndpoint(list(script)))
        return endpoints[-1]

    yield start
    for endpoint in endpoints:
        endpoint.stop()


def test_server_errors_and_rate_limits_are_retried_with_backoff(scripted):
    endpoint = scripted(
        Scripted(500, error_json("boom", kind="server_error")),
        Scripted(429, error_json("slow down", "rate_limit_exceeded"), headers={"retry-after": "3"}),
        Scripted(503, error_json("busy")),
        Scripted(),
    )
    (turn,), sampler, waits = chat(endpoint)
    assert turn.message == {"role": "assistant", "content": "7"}
    assert (turn.prompt_tokens, turn.completion_tokens) == (11, 2)
    assert sampler.retries == 3 and len(endpoint.requests) == 4
    assert waits[1] == 3.0  # Retry-After honoured
    assert 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[2] <= 4.0  # exponential, with jitter
    assert endpoint.requests[0]["max_completion_tokens"] == 8


def test_a_timeout_is_retried_and_then_reported(scripted):
    endpoint = scripted(Scripted(delay_s=2.0), Scripted())
    (turn,), sampler, _ = chat(endpoint, timeout_s=0.5)
    assert turn.message is not None and sampler.retries == 1
    slow = scripted(Scripted(delay_s=2.0))
    with pytest.raises(HostedEndpointError, match="after 2 tries"):
        chat(slow, retries=1, timeout_s=0.3)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (Scripted(401, error_json("bad key", "invalid_api_key")), r"API key from \$MY_KEY"),
        (Scripted(429, error_json("no money", "insufficient_quota")), "quota is spent"),
        (Scripted(404, error_json("no such model", "model_not_found")), "check the base URL"),
        (Scripted(422, error_json("nope")), r"refused the request \(422\).*nope"),
    ],
)
def test_auth_quota_and_other_4xx_stop_at_once_with_what_the_endpoint_said(
    scripted, monkeypatch, answer, says
):
    monkeypatch.setenv("MY_KEY", "k")
    endpoint = scripted(answer, Scripted())
    with pytest.raises(HostedEndpointError, match=says):
        chat(endpoint, key_env="MY_KEY")
    assert len(endpoint.requests) == 1  # not retried


def test_a_prompt_too_long_and_an_unusable_tool_call_end_the_episode_not_the_run(scripted):
    too_long = scripted(Scripted(400, error_json("too long", "context_length_exceeded")))
    (turn,), _, _ = chat(too_long)
    assert turn.finish_reason == "context_overflow" and turn.message is None
    bad_call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "[1]"}}
    unusable = scripted(Scripted(body=completion_json(None, [bad_call])))
    (turn,), _, _ = chat(unusable)
    assert turn.message is None and turn.finish_reason == "stop"

    hosted = HostedModel("m", unusable.base_url, api_key_env=None)
    result = evaluate(hosted, TASKS[:2], lambda task: ToolUseGameEnv(), 2, runs_dir=None)
    assert result.termination["parse_failure"] == 1.0
    overflow = HostedModel("m", too_long.base_url, api_key_env=None)
    result = evaluate(overflow, TASKS[:1], lambda task: ToolUseGameEnv(), runs_dir=None)
    assert result.groups[0].episodes[0].truncation is TruncationCause.CONTEXT_OVERFLOW


def test_requests_in_flight_stay_within_max_concurrency(scripted):
    endpoint = scripted(Scripted(delay_s=0.2))
    turns, _, _ = chat(endpoint, concurrency=2, calls=6)
    assert len(turns) == 6 and endpoint.most_in_flight == 2
