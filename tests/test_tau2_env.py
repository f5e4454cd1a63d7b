"""``Tau2Env`` against τ² itself: the prompt and tools are τ²'s, the agent's calls run on τ²'s
domain environment, the episode ends by τ²'s rules and limits, the reward is τ²'s evaluator's,
``close`` frees the endpoint's connections on every end, and the rollout plays it (a finished
episode and a simulator fault, through ``play_chat_tasks`` with a scripted sampler)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from tau2_common import require_tau2

require_tau2()

from tau2_user_server import UserServer, serving  # noqa: E402

from post_training_cookbook.bundled_envs.tau2 import (  # noqa: E402
    MAX_ERRORS,
    MAX_STEPS,
    Tau2Env,
    UserSimulatorSettings,
    tau2_tasks,
)
from post_training_cookbook.bundled_envs.tau2.data import from_task  # noqa: E402
from post_training_cookbook.bundled_envs.tau2.replay import GoldScript, agent_messages  # noqa: E402
from post_training_cookbook.envs import check_env  # noqa: E402
from post_training_cookbook.envs.base import StepResult, Task  # noqa: E402
from post_training_cookbook.types import Message  # noqa: E402

AIRLINE = tau2_tasks("airline", limit=1)[0]
SOLO = tau2_tasks("telecom", solo=True, limit=1)[0]
GOODBYE = Message(role="assistant", content="Thank you, goodbye!")


def call(name: str, arguments: dict[str, Any] | str, call_id: str = "c1") -> Message:
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    function = {"name": name, "arguments": encoded}
    return Message(
        role="assistant",
        content="",
        tool_calls=[{"id": call_id, "type": "function", "function": function}],
    )


async def episode(env: Tau2Env, task: Task, *messages: Message) -> tuple[list[Message], Any]:
    """reset, then the messages until one ends the episode; close. The opening and the last
    step's result."""
    try:
        opening, result = await env.reset(task), None
        for message in messages:
            result = await env.step(message)
            if result.terminated or result.truncated:
                break
        return opening, result
    finally:
        await env.close()


def gold_env() -> Tau2Env:
    return Tau2Env(user=GoldScript(actions=False))


def test_the_prompt_and_tools_are_tau2s_agents_and_the_user_speaks_first() -> None:
    import tau2.agent.llm_agent as llm_agent
    from tau2.registry import registry

    environment = registry.get_env_constructor("airline")()
    env = gold_env()
    opening, _ = asyncio.run(episode(env, AIRLINE))
    policy_prompt = llm_agent.SYSTEM_PROMPT.format(
        agent_instruction=llm_agent.AGENT_INSTRUCTION, domain_policy=environment.get_policy()
    )
    assert opening[0] == {"role": "system", "content": policy_prompt}
    assert opening[1] == {"role": "assistant", "content": "Hi! How can I help you today?"}
    assert opening[2]["role"] == "user" and len(opening) == 3
    assert env.tool_specs == [tool.openai_schema for tool in environment.get_tools()]


def test_the_agents_calls_run_on_tau2s_domain_environment() -> None:
    from tau2.registry import registry

    environment = registry.get_env_constructor("airline")()
    user_id = next(iter(environment.tools.db.users))
    expected = environment.use_tool("get_user_details", user_id=user_id)

    async def play() -> tuple[StepResult, StepResult]:
        env = gold_env()
        try:
            await env.reset(AIRLINE)
            found = await env.step(call("get_user_details", {"user_id": user_id}, "call_a"))
            missing = await env.step(call("no_such_tool", {}, "call_b"))
            return found, missing
        finally:
            await env.close()

    found, missing = asyncio.run(play())
    assert not (found.terminated or found.truncated)
    assert found.messages[-1]["role"] == "tool" and found.messages[-1]["tool_call_id"] == "call_a"
    assert found.messages[-1]["name"] == "get_user_details"
    assert json.loads(found.messages[-1]["content"]) == expected.model_dump(mode="json")
    assert missing.messages[-1]["content"].startswith("Error:")  # τ²'s answer to a bad call


def test_an_episode_ends_when_the_user_stops_with_tau2s_reward_and_metrics() -> None:
    env = gold_env()
    _, result = asyncio.run(episode(env, AIRLINE, GOODBYE))
    assert result.terminated and not result.truncated
    assert result.reward == env.reward_info.reward
    assert result.metrics["tau2_end_user_stop"] == 1.0
    assert sum(v for k, v in result.metrics.items() if k.startswith("tau2_end_")) == 1.0
    assert result.metrics["tau2_reward"] == result.reward
    assert {"tau2_db", "tau2_communicate"} <= set(result.metrics)  # airline's reward basis
    assert env.simulation.messages[-1].content == "###STOP###"


def test_tau2s_limits_truncate_the_episode_with_no_reward() -> None:
    failing = [call("no_such_tool", {}, f"c{n}") for n in range(MAX_ERRORS)]
    _, errors = asyncio.run(episode(gold_env(), AIRLINE, *failing))
    assert errors.truncated and errors.metrics["tau2_end_too_many_errors"] == 1.0
    assert errors.reward == 0.0 and errors.metrics["tau2_tool_errors"] == MAX_ERRORS
    assert MAX_STEPS == 200  # τ²'s run default, as MAX_ERRORS is its 10
    from tau2 import config

    assert (MAX_STEPS, MAX_ERRORS) == (config.DEFAULT_MAX_STEPS, config.DEFAULT_MAX_ERRORS)
    lookups = [call("get_user_details", {"user_id": "x"}, f"c{n}") for n in range(10)]
    env = Tau2Env(user=GoldScript(actions=False), max_steps=8, max_errors=100)
    _, steps = asyncio.run(episode(env, AIRLINE, *lookups))
    assert steps.truncated and steps.metrics["tau2_end_max_steps"] == 1.0
    assert steps.reward == 0.0


@pytest.mark.parametrize(
    "message",
    [
        Message(role="assistant", content="  "),
        call("get_user_details", "{not json"),
        call("get_user_details", "[1, 2]"),
    ],
    ids=["empty", "arguments-not-json", "arguments-not-an-object"],
)
def test_a_message_tau2s_agent_could_not_send_is_an_agent_error(message: Message) -> None:
    _, result = asyncio.run(episode(gold_env(), AIRLINE, message))
    assert result.terminated and result.reward == 0.0
    assert result.metrics["tau2_end_agent_error"] == 1.0


def test_solo_mode_gives_the_ticket_and_every_tool_and_ends_on_done() -> None:
    from tau2.registry import registry

    _, record = from_task(SOLO)
    environment = registry.get_env_constructor("telecom")(solo_mode=True)
    env = Tau2Env(solo=True)
    opening, result = asyncio.run(episode(env, SOLO, call("done", {})))
    assert [m["role"] for m in opening] == ["system"]
    assert record.ticket in opening[0]["content"]
    assert "main_policy" in opening[0]["content"]  # τ²'s solo policy of the domain
    names = [spec["function"]["name"] for spec in env.tool_specs]
    agent_tools = [tool.name for tool in environment.get_tools()]
    user_tools = [tool.name for tool in environment.get_user_tools()]
    assert names == [*agent_tools, *user_tools, "done"]
    assert result.terminated and result.metrics["tau2_end_agent_stop"] == 1.0
    assert result.reward == 0.0  # nothing was fixed
    _, text = asyncio.run(episode(Tau2Env(solo=True), SOLO, GOODBYE))
    assert text.terminated and text.metrics["tau2_end_agent_error"] == 1.0


def test_bad_settings_and_tasks_are_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="needs a user simulator"):
        Tau2Env()
    with pytest.raises(ValueError, match="solo mode has no user"):
        Tau2Env(user=GoldScript(), solo=True)
    with pytest.raises(ValueError, match="max_steps"):
        Tau2Env(solo=True, max_steps=0)
    with pytest.raises(TypeError, match="user_for"):
        Tau2Env(user="gpt-4.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown τ² domain 'mock'"):
        tau2_tasks("mock")
    with pytest.raises(ValueError, match="no solo mode"):
        tau2_tasks("airline", solo=True)
    with pytest.raises(ValueError, match="no split 'held_out'"):
        tau2_tasks("retail", "held_out")
    with pytest.raises(ValueError, match="not a τ² task"):
        asyncio.run(episode(Tau2Env(solo=True), Task(prompt="hi")))
    with pytest.raises(ValueError, match="has no ticket"):
        asyncio.run(episode(Tau2Env(solo=True), AIRLINE))


def test_tau2_tasks_are_tau2s_splits_and_carry_the_whole_task() -> None:
    from tau2.registry import registry

    for domain, sizes in {"airline": (50, 30, 20), "retail": (114, 74, 40)}.items():
        assert tuple(len(tau2_tasks(domain, split)) for split in ("base", "train", "test")) == sizes
    assert len(tau2_tasks("telecom")) == 114 and len(tau2_tasks("telecom", "small")) == 20
    published = registry.get_tasks_loader("retail")("test")
    tasks = tau2_tasks("retail", "test")
    assert [from_task(task)[1] for task in tasks] == published
    assert tasks[0].prompt == published[0].user_scenario.instructions.reason_for_call


def connection_threads() -> int:
    return sum("process_request" in thread.name for thread in threading.enumerate())


def wait_for(predicate: Any, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(predicate())


@pytest.mark.parametrize("end", ["finished", "step_raised", "closed_after_reset"])
def test_close_frees_the_endpoints_connections_on_every_end(end: str) -> None:
    script = {"finished": ["say:Hello.", "say:###STOP###"], "step_raised": ["say:Hello."]}
    server = UserServer(script.get(end, ["say:Hello."]), default="status:400")
    with serving(server) as url:
        user = UserSimulatorSettings("fake", base_url=url, api_key_env=None, max_attempts=1)

        async def play() -> tuple[int, BaseException | None]:
            env = Tau2Env(user=user)
            raised = None
            try:
                await env.reset(AIRLINE)
                open_connections = connection_threads()
                if end != "closed_after_reset":
                    await env.step(GOODBYE)
            except Exception as exc:
                raised = exc
            finally:
                await env.close()
                await env.close()  # twice is harmless
            return open_connections, raised

        open_connections, raised = asyncio.run(play())
        assert open_connections >= 1  # a kept-alive connection while the episode ran
        assert (raised is not None) == (end == "step_raised")
        assert wait_for(lambda: connection_threads() == 0)  # closed by close()


def test_check_env_finds_no_contract_violation() -> None:
    with serving(UserServer(default="say:Alright.")) as url:
        user = UserSimulatorSettings("fake", base_url=url, api_key_env=None)
        report = check_env(lambda task: Tau2Env(user=user), tau2_tasks("retail", limit=1))
    assert report.errors == [], str(report)
    # the one warning: text goes to τ²'s user and does not end the episode; the user does
    (warning,) = report.warnings
    assert "a final answer (an assistant message without tool calls) did not end" in warning
    solo = check_env(lambda task: Tau2Env(solo=True), tau2_tasks("telecom", solo=True, limit=1))
    assert solo.errors == solo.warnings == [], str(solo)  # a text reply ends a solo episode


class ScriptedSampler:
    """A chat sampler that answers with fixed messages, in order: the policy's side."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = list(messages)

    async def chat(self, messages: list[Message], tools: Any, params: Any) -> Any:
        from post_training_cookbook.rollout.chat import ChatTurn

        return ChatTurn(self.messages.pop(0), "stop")


def play_through_rollout(task: Task, env_factory: Any, replies: list[Message]) -> Any:
    """``evaluate`` with the scripted policy: one episode, env errors truncating."""
    from post_training_cookbook.evaluation import evaluate

    sampler = ScriptedSampler(replies)
    return evaluate(
        sampler, [task], env_factory, max_turns=20, env_errors="truncate", runs_dir=None
    )


def test_the_rollout_plays_an_episode_and_records_tau2s_reward() -> None:
    task = tau2_tasks("retail", limit=1)[0]
    _, record = from_task(task)
    replies = agent_messages(record, solo=False)
    result = play_through_rollout(task, lambda task: Tau2Env(user=GoldScript()), replies)
    played = result.groups[0].episodes[0]
    assert played.env_error is None and played.truncation is None
    assert played.reward == 1.0 and played.metrics["tau2_end_user_stop"] == 1.0
    assert played.num_turns == len(replies)
    assert result.reward_mean == 1.0 and result.metrics["eval/env/tau2_reward"] == 1.0


def test_a_simulator_fault_is_an_env_error_naming_its_cause_in_the_rollout() -> None:
    with serving(UserServer(["say:Hello."], default="hang")) as url:
        user = UserSimulatorSettings("fake", base_url=url, api_key_env=None, timeout_s=0.5)
        result = play_through_rollout(AIRLINE, lambda task: Tau2Env(user=user), [GOODBYE])
    played = result.groups[0].episodes[0]
    assert played.truncation is not None and played.truncation.value == "env"
    assert "τ² user simulator: timeout" in played.env_error
    assert played.reward == 0.0 and "tau2_reward" not in played.metrics


def test_the_docs_example_builds_its_runs_as_printed() -> None:
    from pathlib import Path

    from post_training_cookbook.grpo.config import GRPOConfig

    page = (Path(__file__).resolve().parents[1] / "docs" / "tau2.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    runs: list[tuple[Any, list[Task], Any, Any]] = []

    def train_multi_turn(config: Any, tasks: Any, env_factory: Any, val_tasks: Any = None) -> None:
        runs.append((config, tasks, env_factory, val_tasks))  # what the loop would be given

    code = example.replace("from post_training_cookbook.grpo.train import train_multi_turn\n", "")
    exec(compile(code, "docs/tau2.md", "exec"), {"train_multi_turn": train_multi_turn})
    (config, train, conversation, test), (_, solo, solo_factory, _) = runs
    assert isinstance(config, GRPOConfig) and config.env_step_timeout_s == 120
    assert (len(train), len(test), len(solo)) == (74, 40, 114)
    assert isinstance(conversation(train[0]), Tau2Env) and conversation(train[0]).user
    assert solo_factory(solo[0]).solo


def test_a_user_who_stops_at_once_ends_the_episode_at_the_first_step() -> None:
    with serving(UserServer(["say:Never mind. ###STOP###"])) as url:
        user = UserSimulatorSettings("fake", base_url=url, api_key_env=None)
        opening, result = asyncio.run(episode(Tau2Env(user=user), AIRLINE, GOODBYE))
    assert opening[-1]["content"] == "Never mind. ###STOP###"
    assert result.terminated and result.metrics["tau2_end_user_stop"] == 1.0
