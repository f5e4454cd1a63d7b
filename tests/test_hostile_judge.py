"""A judge, hosted model or endpoint teacher that answers with a huge body: the call fails
once the body passes ``max_response_bytes`` (for the judge an env error, for the teacher a
failed call, under the policy), not retried, and nothing past it is held."""

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


def teacher_answer(tokens: list[int], padding: int) -> dict[str, Any]:
    """A ``/v1/completions`` answer scoring ``tokens`` (each -1.0), ``padding`` bytes long."""
    entries = [None] + [{str(token): {"logprob": -1.0}} for token in tokens[1:]]
    return {"choices": [{"index": 0, "text": "x" * padding, "prompt_logprobs": entries}]}


class ZeroStudent:
    async def forward(self, samples: list[Any]) -> list[list[float]]:
        return [[0.0] * len(sample.tokens) for sample in samples]


def test_an_endpoint_teacher_s_answer_past_max_response_bytes_follows_env_errors() -> None:
    from test_serve_common import Scripted, ScriptedEndpoint

    from post_training_cookbook.distill import DistillSettings, EndpointTeacher, distill_batch
    from post_training_cookbook.distill.types import TeacherError
    from post_training_cookbook.trainer.types import TrainingSample

    tokens = [5, 6, 7, 8]
    sample = TrainingSample(tokens, [0.0, 0.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4)
    endpoint = ScriptedEndpoint(
        [Scripted(body=teacher_answer(tokens, 1_500_000))], path="/v1/completions"
    )

    async def distil(env_errors: str, limit: int | None) -> tuple[list[TrainingSample], dict]:
        teacher = EndpointTeacher(endpoint.base_url, model="m", max_response_bytes=limit)
        settings = DistillSettings(env_errors=env_errors, sequences_per_call=1)  # type: ignore[arg-type]
        try:
            return await distill_batch([sample], teacher, ZeroStudent(), settings)  # type: ignore[arg-type]
        finally:
            await teacher.close()

    try:
        with pytest.raises(TeacherError, match="max_response_bytes=100,000"):
            asyncio.run(distil("raise", 100_000))
        assert len(endpoint.requests) == 1  # refused, not retried
        # the default bound: 1,000 bytes a token sent, at least 1 MB
        with pytest.raises(TeacherError, match="max_response_bytes=1,000,000"):
            asyncio.run(distil("raise", None))
        kept, metrics = asyncio.run(distil("truncate", None))
        assert kept == [] and metrics["distill/teacher_failed_samples"] == 1.0
        kept, metrics = asyncio.run(distil("raise", 2_000_000))
        assert metrics["distill/teacher_failed_samples"] == 0.0
        assert kept[0].advantages == [0.0, 0.0, -1.0, -1.0]  # −(0 − (−1)) on each
    finally:
        endpoint.stop()


def test_an_endpoint_teacher_quotes_a_failed_answer_s_head_and_refuses_a_body_not_an_object():
    from test_serve_common import Scripted, ScriptedEndpoint

    from post_training_cookbook.distill import EndpointTeacher
    from post_training_cookbook.distill.types import TeacherCallError
    from post_training_cookbook.trainer.types import TrainingSample

    sample = TrainingSample([5, 6], [0.0, 1.0], [0.0] * 2, [0.0] * 2)
    failing = Scripted(status=500, body={"error": "y" * 2_000_000})
    listed = Scripted(body=[1, 2])  # type: ignore[arg-type]
    endpoint = ScriptedEndpoint([failing, failing, listed], path="/v1/completions")

    async def score() -> Any:
        teacher = EndpointTeacher(endpoint.base_url, model="m", retries=1)
        try:
            return await teacher.score([sample])
        finally:
            await teacher.close()

    try:
        with pytest.raises(TeacherCallError, match="after 2 attempts: HTTP 500") as failed:
            asyncio.run(score())
        assert len(str(failed.value)) < 500  # the body's first 300 bytes, no more
        with pytest.raises(TeacherCallError, match="answered a JSON list, not an object"):
            asyncio.run(score())
    finally:
        endpoint.stop()


def test_the_run_s_endpoint_teacher_takes_its_max_response_bytes() -> None:
    from post_training_cookbook.distill.teacher import open_teacher
    from post_training_cookbook.grpo.config import GRPOConfig, TeacherConfig
    from post_training_cookbook.grpo.settings import RunSettings
    from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model

    endpoint = "http://127.0.0.1:9/v1"
    config = GRPOConfig(teacher=TeacherConfig(source=endpoint, max_response_bytes=5_000))
    spec = RunSettings.from_config(config, resolve_model(BUNDLED_MODEL_ID)).teacher
    assert spec is not None and spec.max_response_bytes == 5_000

    async def opened() -> int | None:
        teacher = await open_teacher(spec, BUNDLED_MODEL_ID)
        try:
            return teacher.max_response_bytes  # type: ignore[attr-defined]
        finally:
            await teacher.close()

    assert asyncio.run(opened()) == 5_000
    with pytest.raises(ValueError, match=r"teacher\.max_response_bytes must be >= 1"):
        GRPOConfig(teacher=TeacherConfig(source=endpoint, max_response_bytes=0))
    with pytest.raises(ValueError, match="bounds an endpoint teacher's answers"):
        GRPOConfig(teacher=TeacherConfig(source="runs/local", max_response_bytes=5_000))
