"""One event loop per process for the sync entry points: an async client built once (at
import, as docs/agents.md advises for the sync client) keeps working across calls, where a
new loop per call left its pooled connections on a closed one ("Event loop is closed")."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
from test_serve_common import Scripted, ScriptedEndpoint

from post_training_cookbook.sync import process_loop, run_sync

CLIENT = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0)
"""Built at import, before any loop exists; each test points it at its endpoint."""


@pytest.fixture
def endpoint():
    served = ScriptedEndpoint([Scripted()])
    yield served
    served.stop()


async def two_requests(base_url: str) -> list[str]:
    client = CLIENT.with_options(base_url=base_url)  # shares CLIENT's connection pool
    replies = []
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        replies.append(reply.choices[0].finish_reason)
    return replies


def test_a_client_built_at_import_serves_three_sync_calls(endpoint) -> None:
    for _ in range(3):
        assert run_sync(two_requests(endpoint.base_url)) == ["stop", "stop"]
    assert len(endpoint.requests) == 6


def test_inside_a_running_loop_the_call_runs_on_the_process_loop_too(endpoint) -> None:
    async def notebook_cell() -> list[str]:
        return run_sync(two_requests(endpoint.base_url))

    assert run_sync(two_requests(endpoint.base_url)) == ["stop", "stop"]
    assert asyncio.run(notebook_cell()) == ["stop", "stop"]
    assert run_sync(two_requests(endpoint.base_url)) == ["stop", "stop"]


def test_tasks_a_call_leaves_running_are_cancelled_when_it_returns() -> None:
    left: list[asyncio.Task[None]] = []

    async def leaves_a_task() -> None:
        left.append(asyncio.ensure_future(asyncio.sleep(60)))

    run_sync(leaves_a_task())
    assert left[0].cancelled()
    assert not process_loop().is_closed()


def test_calls_from_two_threads_at_once_both_finish() -> None:
    gate = threading.Barrier(2, timeout=10)
    results: list[int] = []

    async def waits(value: int) -> int:
        await asyncio.to_thread(gate.wait)
        return value

    other = threading.Thread(target=lambda: results.append(run_sync(waits(1))))
    other.start()
    results.append(run_sync(waits(2)))
    other.join(timeout=20)
    assert sorted(results) == [1, 2]


def test_an_error_in_a_call_leaves_the_loop_usable() -> None:
    async def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        run_sync(fails())

    async def fine() -> int:
        return 7

    assert run_sync(fine()) == 7


AGENT_CLIENT = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
"""The agent's one client, built at import: each episode points a copy (sharing its
connection pool) at the episode's base URL."""


async def one_client_agent(base_url, api_key, task) -> float:
    client = AGENT_CLIENT.with_options(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": task.prompt}]
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=8
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        messages.append({"role": "user", "content": "Again."})
    return 1.0 if "1" in (reply.choices[0].message.content or "") else 0.0


def test_an_async_agent_with_one_client_built_at_import_trains_in_three_runs(tmp_path) -> None:
    from test_agents import agent_config

    from post_training_cookbook.agents import AgentEnvs
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS
    from post_training_cookbook.grpo.train import train_multi_turn

    for run in range(3):
        config = agent_config(
            tmp_path, run_name=f"agent{run}", num_steps=1, batch_size=1, episodes_per_task=2,
            env_errors="raise",
        )  # fmt: skip
        with AgentEnvs(one_client_agent) as env_factory:
            folder = train_multi_turn(config, TOOL_USE_GAME_TRAIN_TASKS[:2], env_factory).path
        assert (folder / "final_model").is_dir()


def test_a_judge_built_once_scores_in_three_sync_calls_without_a_retry(monkeypatch) -> None:
    from test_serve_common import completion_json

    from post_training_cookbook.envs import JudgeReward, OpenAIJudge, Task
    from post_training_cookbook.types import Message

    served = ScriptedEndpoint([Scripted(body=completion_json("Fine.\nScore: 7"))])
    monkeypatch.setenv("COOKBOOK_TEST_LOOP_KEY", "sk-loopback-only")
    try:
        judge = OpenAIJudge("j", base_url=served.base_url, api_key_env="COOKBOOK_TEST_LOOP_KEY")
        reward = JudgeReward(judge, rubric="Is it right?", max_attempts=1, backoff_s=0.0)
        for number in range(3):
            answer = Message(role="assistant", content=f"answer {number}")
            assert run_sync(reward(answer, Task(prompt="q"))) == 0.7
        assert reward.stats.retries == 0 and len(served.requests) == 3
    finally:
        served.stop()
