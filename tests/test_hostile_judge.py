"""A judge endpoint that answers with a huge body: the judgement fails once the body passes
``max_response_bytes`` (an env error under the policy), and nothing past it is held."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from judge_server import JudgeServer, serving
from test_judge import KEY_ENV, TASK, reply

from post_training_cookbook.envs import JudgeError, JudgeReward, OpenAIJudge


class HugeAnswers(JudgeServer):
    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        status, payload = super().answer(body)
        payload["choices"][0]["message"]["content"] = "x" * 3_000_000 + "\nScore: 7"
        return status, payload


def test_a_judge_answer_past_max_response_bytes_is_a_judge_error(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-loopback-only")
    server = HugeAnswers(slow_s=0.0)
    with serving(server) as url:
        judge = OpenAIJudge("judge-model", base_url=url, api_key_env=KEY_ENV)
        reward = JudgeReward(judge, rubric="Is it complete?", backoff_s=0.0)
        with pytest.raises(JudgeError, match="max_response_bytes=1,000,000"):
            asyncio.run(reward(reply("bread"), TASK))
        assert len(server.requests) == 1  # refused, not retried

        roomy = OpenAIJudge(
            "judge-model", base_url=url, api_key_env=KEY_ENV, max_response_bytes=10_000_000
        )
        assert asyncio.run(JudgeReward(roomy, rubric="Is it complete?")(reply("b"), TASK)) == 0.7


def test_max_response_bytes_must_be_positive(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-loopback-only")
    with pytest.raises(ValueError, match="max_response_bytes"):
        OpenAIJudge("judge-model", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV,
                    max_response_bytes=0)  # fmt: skip


def test_a_hosted_models_answer_past_max_response_bytes_is_an_endpoint_error() -> None:
    from test_serve_common import Scripted, ScriptedEndpoint, completion_json

    from post_training_cookbook.engine.types import SamplingParams
    from post_training_cookbook.evaluation.hosted import (
        HostedEndpointError,
        HostedModel,
        OpenAIChatSampler,
    )

    huge = completion_json()
    huge["choices"][0]["message"]["content"] = "x" * 300_000
    endpoint = ScriptedEndpoint([Scripted(body=huge)])
    try:

        async def ask(limit: int) -> Any:
            hosted = HostedModel("m", endpoint.base_url, api_key_env=None, max_response_bytes=limit)
            sampler = OpenAIChatSampler(hosted, "a-key")
            try:
                messages = [{"role": "user", "content": "q"}]
                return await sampler.chat(messages, [], SamplingParams(max_tokens=8))
            finally:
                await sampler.close()

        with pytest.raises(HostedEndpointError, match="max_response_bytes=100,000"):
            asyncio.run(ask(100_000))
        assert len(endpoint.requests) == 1  # not retried
        assert len(asyncio.run(ask(1_000_000)).message["content"]) == 300_000
    finally:
        endpoint.stop()
    with pytest.raises(ValueError, match="max_response_bytes"):
        HostedModel("m", "http://127.0.0.1:9/v1", api_key_env=None, max_response_bytes=0)
