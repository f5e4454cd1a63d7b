"""The tool-use game and the calculator env rewritten on ``ToolEnv`` give what they gave
before the rewrite (``envs_before_tool_env.py`` keeps those versions verbatim): the same
messages, rewards, endings and metrics, step by step, on the same scripted episodes — the
game's oracle and imperfect player on every task, and random scripts of good, bad and
unknown tool calls and answers."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from envs_before_tool_env import GameEnvBefore, MathEnvBefore
from hypothesis import given, settings
from hypothesis import strategies as st

from post_training_cookbook.bundled_envs.calculator import CALCULATOR_TASKS, MathEnv
from post_training_cookbook.envs import Env, StepResult, Task, ToolEnv, ToolResult
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.envs.tool_use_game.scripted_player import (
    BUNDLED_MODEL_PLAYER,
    ORACLE,
    parse_question,
    play,
)
from post_training_cookbook.types import Message, ToolCall


def same_result(before: StepResult, after: StepResult) -> None:
    assert (after.terminated, after.truncated, after.reward) == (
        before.terminated,
        before.truncated,
        before.reward,
    )
    assert after.metrics == before.metrics
    assert after.messages == before.messages


async def step_both(before: Env, after: Env, message: Message) -> StepResult:
    old, new = await before.step(message), await after.step(message)
    same_result(old, new)
    assert after.messages == before.messages
    return old


async def play_player_on_both(task: Task, seed: int, errors: Any) -> StepResult:
    """The player's episode on both envs at once: each message goes to both, and the script
    reads the (equal) tool results."""
    before, after = GameEnvBefore(), ToolUseGameEnv()
    assert await after.reset(task) == await before.reset(task)
    assert after.tool_specs == before.tool_specs
    script = play(parse_question(task.prompt), random.Random(seed), errors)
    message = next(script)
    while True:
        seen = len(before.messages) + 1
        result = await step_both(before, after, message)
        if result.terminated or result.truncated:
            return result
        message = script.send(result.messages[seen:])


@pytest.mark.parametrize("errors", [ORACLE, BUNDLED_MODEL_PLAYER], ids=["oracle", "player"])
def test_the_game_on_tool_env_plays_every_task_as_before(errors: Any) -> None:
    async def every_task() -> list[float]:
        return [
            (await play_player_on_both(task, index, errors)).reward
            for index, task in enumerate(TOOL_USE_GAME_TASKS)
        ]

    rewards = asyncio.run(every_task())
    mean = sum(rewards) / len(rewards)
    assert mean == 1.0 if errors is ORACLE else 0.2 < mean < 0.8


def call(name: str, arguments: str, call_id: str) -> ToolCall:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


GAME_ARGUMENTS = st.one_of(
    st.sampled_from(
        ['{"key": "kalo.weight"}', '{"prefix": "ka"}', '{"expression": "6 / 4"}', "{}", "{bad"]
    ),
    st.builds(lambda key: json.dumps({"key": key}), st.sampled_from(["x", "zuren.age"])),
    st.text(max_size=20),
)
GAME_CALLS = st.lists(
    st.tuples(
        st.sampled_from(["lookup", "list_fact_keys", "calculator", "submit", "nope"]),
        GAME_ARGUMENTS,
    ),
    max_size=3,
)
REPLIES = st.sampled_from(["42", " 7 ", "1.50", "", "seven", "-3"])
TURNS = st.lists(st.tuples(GAME_CALLS, REPLIES), min_size=1, max_size=6)


class SubmitTool:
    """Ends the episode (``should_stop``): the game grades the message that called it."""

    name = "submit"
    description = "Submit the answer in your message and end the episode."
    parameters_schema: dict[str, Any] = {"type": "object", "properties": {}}

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content="submitted", should_stop=True)


def scripted_messages(turns: list[Any]) -> list[Message]:
    messages = []
    for index, (calls, reply) in enumerate(turns):
        message = Message(role="assistant", content=reply)
        if calls:
            message["tool_calls"] = [
                call(name, arguments, f"call_{index}_{number}")
                for number, (name, arguments) in enumerate(calls)
            ]
        messages.append(message)
    return messages


async def play_script_on_both(before: Env, after: Env, task: Task, script: list[Message]) -> None:
    assert await after.reset(task) == await before.reset(task)
    for message in script:
        result = await step_both(before, after, message)
        if result.terminated or result.truncated:
            return


@settings(max_examples=300, deadline=None, database=None)
@given(TURNS, st.sampled_from(TOOL_USE_GAME_TASKS[:50]), st.integers(1, 4))
def test_the_game_answers_any_script_of_calls_and_replies_as_before(
    turns: list[Any], task: Task, max_turns: int
) -> None:
    before = GameEnvBefore(max_turns=max_turns, extra_tools=[SubmitTool()])
    after = ToolUseGameEnv(max_turns=max_turns, extra_tools=[SubmitTool()])
    task = Task(task.prompt, "42", task.metadata)
    asyncio.run(play_script_on_both(before, after, task, scripted_messages(turns)))


MATH_CALLS = st.lists(
    st.tuples(
        st.sampled_from(["calculator", "calculator", "python"]),
        st.one_of(
            st.builds(
                lambda e: json.dumps({"expression": e}),
                st.sampled_from(["17 * (4 + 9)", "6 / 3", "2 ** 1000", "1 / 0", "x", "("]),
            ),
            st.sampled_from(["{}", '{"expression": 5}', "[1]", "not json"]),
        ),
    ),
    max_size=3,
)
MATH_TURNS = st.lists(
    st.tuples(MATH_CALLS, st.sampled_from(["221", " 221 ", "2", "", "abc"])),
    min_size=1,
    max_size=5,
)


class UnknownToolsAnsweredAlike(MathEnvBefore):
    """The old MathEnv, with the one documented departure: an unknown tool's error names the
    tools there are (``KeyError('python')`` before)."""

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        calls = {call["id"]: call["function"]["name"] for call in message.get("tool_calls", [])}
        for tool_message in result.messages:
            name = calls.get(tool_message.get("tool_call_id", ""))
            if name is not None and name != "calculator":
                error = ValueError(f"unknown tool '{name}'; available: calculator")
                tool_message["content"] = f"tool_error: {error!r}"
        return result


@settings(max_examples=300, deadline=None, database=None)
@given(MATH_TURNS, st.sampled_from(["221", "2", "1024"]))
def test_the_calculator_env_answers_any_script_as_before(turns: list[Any], target: str) -> None:
    task = Task(prompt=CALCULATOR_TASKS[0].prompt, target=target)
    script = scripted_messages(turns)
    asyncio.run(play_script_on_both(UnknownToolsAnsweredAlike(), MathEnv(), task, script))


def test_both_rewritten_envs_are_tool_envs_with_the_tool_specs_they_had() -> None:
    assert isinstance(ToolUseGameEnv(), ToolEnv) and isinstance(MathEnv(), ToolEnv)
    assert ToolUseGameEnv().tool_specs == GameEnvBefore().tool_specs
    assert MathEnv().tool_specs == MathEnvBefore().tool_specs
