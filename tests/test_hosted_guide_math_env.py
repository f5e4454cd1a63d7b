"""The docs' "Write an environment" example runs unchanged, and the packaged MathEnv agrees.

The example is pasted verbatim below (``fmt: off`` keeps the formatter from touching it), with
``safe_eval`` imported from the package as a user who "defines it before training" would.
"""

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from post_training_cookbook.bundled_envs.calculator import MathEnv as PackagedMathEnv
from post_training_cookbook.envs.arithmetic import safe_eval

# isort: split
# fmt: off
# ---- the example, verbatim ----
import json

from post_training_cookbook.envs import (
    Env,
    StepResult,
    Task,
    Tool,
    ToolResult,
    tool_to_spec,
)
from post_training_cookbook.types import Message, ToolSpec

SYSTEM_PROMPT = (
    "Use the calculator tool, then reply with only the final number."
)


class CalculatorTool:
    name = "calculator"
    description = "Evaluate an arithmetic expression."
    parameters_schema = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        expression = json.loads(arguments)["expression"]
        # safe_eval is your own arithmetic evaluator. Define it before you
        # train. Until you do, every call returns a tool_error, because the
        # step's except catches the NameError. Never eval() model output.
        return ToolResult(content=str(safe_eval(expression)))


class MathEnv(Env):
    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._tools: dict[str, Tool] = {"calculator": CalculatorTool()}

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._messages = [
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=task.prompt),
        ]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        tool_calls = message.get("tool_calls", [])
        if not tool_calls:
            # No tool calls: treat the message as the final answer.
            correct = message.get("content", "").strip() == str(
                self._task.target
            )
            return StepResult(
                terminated=True,
                truncated=False,
                messages=list(self._messages),
                reward=1.0 if correct else 0.0,
            )
        for call in tool_calls:
            name = call["function"]["name"]
            try:
                tool = self._tools[name]
                result = await tool.execute(call["function"]["arguments"])
                content = result.content
            except Exception as exc:
                # Report a bad tool call to the model. An uncaught
                # exception here stops the whole training run.
                content = f"tool_error: {exc!r}"
            self._messages.append(
                Message(
                    role="tool",
                    content=content,
                    tool_call_id=call["id"],
                    name=name,
                )
            )
        return StepResult(
            terminated=False,
            truncated=False,
            messages=list(self._messages),
            reward=0.0,
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)
# ---- end of the example ----
# fmt: on

ENV_CLASSES = {"hosted guide example": MathEnv, "packaged": PackagedMathEnv}
TASK = Task(prompt="What is 17 * (4 + 9)?", target="221")


def tool_call(expression: str, call_id: str = "call_0", name: str = "calculator") -> Message:
    arguments = json.dumps({"expression": expression})
    return Message(
        role="assistant",
        content="",
        tool_calls=[
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    )


def answer(content: str) -> Message:
    return Message(role="assistant", content=content)


def play(env: Env, task: Task, script: list[Message]) -> list[StepResult]:
    """Reset ``env`` on ``task`` and step it through ``script``; every step's result."""

    async def episode() -> list[StepResult]:
        await env.reset(task)
        results = [await env.step(message) for message in script]
        await env.close()
        return results

    return asyncio.run(episode())


@pytest.mark.parametrize("env_class", ENV_CLASSES.values(), ids=ENV_CLASSES.keys())
def test_reset_opens_with_the_system_prompt_and_the_task(env_class: type[Env]) -> None:
    opening = asyncio.run(env_class().reset(TASK))
    assert opening == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASK.prompt},
    ]


@pytest.mark.parametrize("env_class", ENV_CLASSES.values(), ids=ENV_CLASSES.keys())
def test_a_tool_call_then_the_right_answer_earns_reward_one(env_class: type[Env]) -> None:
    first, last = play(env_class(), TASK, [tool_call("17 * (4 + 9)"), answer(" 221\n")])
    assert (first.terminated, first.truncated, first.reward) == (False, False, 0.0)
    assert first.messages[-1] == {
        "role": "tool",
        "content": "221",
        "tool_call_id": "call_0",
        "name": "calculator",
    }
    assert (last.terminated, last.truncated, last.reward) == (True, False, 1.0)
    assert [m["role"] for m in last.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


@pytest.mark.parametrize("env_class", ENV_CLASSES.values(), ids=ENV_CLASSES.keys())
@pytest.mark.parametrize("reply", ["222", "221.0", "The answer is 221", ""])
def test_a_wrong_final_answer_earns_reward_zero(env_class: type[Env], reply: str) -> None:
    *_, last = play(env_class(), TASK, [tool_call("17 * (4 + 9)"), answer(reply)])
    assert (last.terminated, last.reward) == (True, 0.0)


@pytest.mark.parametrize("env_class", ENV_CLASSES.values(), ids=ENV_CLASSES.keys())
@pytest.mark.parametrize(
    ("expression", "name"),
    [("17 * (", "calculator"), ("__import__('os')", "calculator"), ("1", "python")],
)
def test_a_bad_tool_call_becomes_a_tool_error_message_and_the_episode_goes_on(
    env_class: type[Env], expression: str, name: str
) -> None:
    bad, good, last = play(
        env_class(),
        TASK,
        [
            tool_call(expression, "call_bad", name),
            tool_call("17 * (4 + 9)", "call_ok"),
            answer("221"),
        ],
    )
    assert not bad.terminated and not bad.truncated
    report = bad.messages[-1]
    assert report["role"] == "tool" and report["tool_call_id"] == "call_bad"
    assert report.get("content", "").startswith("tool_error: ")
    assert good.messages[-1].get("content") == "221"
    assert last.reward == 1.0


@pytest.mark.parametrize("env_class", ENV_CLASSES.values(), ids=ENV_CLASSES.keys())
def test_an_answer_without_any_tool_call_ends_the_episode_at_once(env_class: type[Env]) -> None:
    (only,) = play(env_class(), TASK, [answer("221")])
    assert (only.terminated, only.reward) == (True, 1.0)


def test_both_envs_offer_one_calculator_tool_with_a_required_string_expression() -> None:
    for env in (MathEnv(), PackagedMathEnv()):
        (spec,) = env.tool_specs
        assert spec["type"] == "function"
        assert spec["function"]["name"] == "calculator"
        parameters = spec["function"]["parameters"]
        assert parameters["required"] == ["expression"]
        assert parameters["properties"]["expression"]["type"] == "string"


SCRIPTED_TURNS = st.one_of(
    st.tuples(
        st.sampled_from(["calculator", "python"]),
        st.one_of(
            st.sampled_from(["17 * (4 + 9)", "6 / 3", "7 // 2", "2 ** 10", "1 / 0", "x", "("]),
            st.text(max_size=30),
        ),
    ),
    st.sampled_from(["221", "222", " 221 ", "2", "", "abc"]),
)


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(SCRIPTED_TURNS, max_size=4), st.sampled_from(["221", "2", "1024"]))
def test_packaged_env_agrees_with_the_example_on_rewards_endings_and_tool_errors(
    turns: list[Any], target: str
) -> None:
    script = [
        tool_call(t[1], f"call_{i}", t[0]) if isinstance(t, tuple) else answer(t)
        for i, t in enumerate(turns)
    ]
    script = script[: next((i + 1 for i, m in enumerate(script) if "tool_calls" not in m), None)]
    task = Task(prompt="?", target=target)
    guide_results = play(MathEnv(), task, script)
    packaged_results = play(PackagedMathEnv(), task, script)
    for guide, packaged in zip(guide_results, packaged_results, strict=True):
        assert (guide.terminated, guide.truncated, guide.reward) == (
            packaged.terminated,
            packaged.truncated,
            packaged.reward,
        )
        assert len(guide.messages) == len(packaged.messages)
        for ours, theirs in zip(guide.messages, packaged.messages, strict=True):
            assert ours["role"] == theirs["role"]
            if ours["role"] != "tool":
                continue
            assert ours["tool_call_id"] == theirs["tool_call_id"]
            guide_text, packaged_text = ours.get("content", ""), theirs.get("content", "")
            assert guide_text.startswith("tool_error: ") == packaged_text.startswith("tool_error: ")
            if not guide_text.startswith("tool_error: "):  # same number; ours prints 2.0 as 2
                assert float(guide_text) == pytest.approx(float(packaged_text))
