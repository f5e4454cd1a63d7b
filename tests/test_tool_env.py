"""``ToolEnv``: dispatch, tool errors, endings (final answer, ``should_stop``, tool-call and turn
limits), rewards and rubrics, the env's own ``@function_tool`` methods, and the parts a
subclass overrides."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from transformers.utils import get_json_schema

from post_training_cookbook.envs import (
    Rubric,
    StepResult,
    Task,
    ToolEnv,
    ToolResult,
    check_env,
    exact_answer,
    function_tool,
    numeric_answer,
)
from post_training_cookbook.types import Message, ToolCall

TASK = Task(prompt="What is 2 + 3?", target="5")


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Submit:
    name = "submit"
    description = "Submit the answer written in your message."
    parameters_schema: dict[str, Any] = {"type": "object", "properties": {}}

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content="submitted", should_stop=True)


def calls(*pairs: tuple[str, dict[str, Any]], content: str = "") -> Message:
    tool_calls: list[ToolCall] = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(pairs)
    ]
    return Message(role="assistant", content=content, tool_calls=tool_calls)


def reply(content: str) -> Message:
    return Message(role="assistant", content=content)


def play(env: ToolEnv, *script: Message, task: Task = TASK) -> list[StepResult]:
    async def episode() -> list[StepResult]:
        await env.reset(task)
        return [await env.step(message) for message in script]

    return asyncio.run(episode())


def test_tool_calls_are_answered_in_order_and_a_final_reply_is_scored() -> None:
    env = ToolEnv([add], system_prompt="Add.", reward_fn=exact_answer)
    first, last = play(env, calls(("add", {"a": 2, "b": 3}), ("nope", {})), reply("5"))
    assert (first.terminated, first.truncated) == (False, False)
    assert [(m["role"], m.get("content")) for m in first.messages] == [
        ("system", "Add."),
        ("user", TASK.prompt),
        ("assistant", ""),
        ("tool", "5"),
        ("tool", "tool_error: unknown tool 'nope'; available: add"),
    ]
    assert (last.terminated, last.reward) == (True, 1.0)
    assert last.metrics == {"num_tool_calls": 2.0, "num_tool_errors": 1.0, "num_turns": 2.0}


def test_without_a_system_prompt_the_episode_opens_with_the_task() -> None:
    env = ToolEnv([add], reward_fn=exact_answer)
    assert asyncio.run(env.reset(TASK)) == [{"role": "user", "content": TASK.prompt}]


def test_a_tool_asking_to_stop_ends_the_episode_graded_on_the_message_that_called_it() -> None:
    (ended,) = play(
        ToolEnv([add, Submit()], reward_fn=exact_answer), calls(("submit", {}), content="5")
    )
    assert (ended.terminated, ended.reward) == (True, 1.0)


def test_a_message_whose_calls_would_pass_max_tool_calls_truncates_without_running_them() -> None:
    env = ToolEnv([add], reward_fn=exact_answer, max_tool_calls=2)
    first, second = play(
        env,
        calls(("add", {"a": 1, "b": 1})),
        calls(("add", {"a": 1, "b": 2}), ("add", {"a": 0, "b": 0})),
    )
    assert not first.truncated
    assert (second.terminated, second.truncated, second.reward) == (False, True, 0.0)
    assert second.messages[-1]["role"] == "assistant"  # the two calls did not run
    assert second.metrics["num_tool_calls"] == 1.0


def test_the_episode_is_truncated_after_max_turns_assistant_turns() -> None:
    env = ToolEnv([add], reward_fn=exact_answer, max_turns=2)
    results = play(env, calls(("add", {"a": 1, "b": 1})), calls(("add", {"a": 1, "b": 1})))
    assert [(r.terminated, r.truncated) for r in results] == [(False, False), (False, True)]
    assert results[-1].metrics["num_turns"] == 2.0


def test_a_rubric_weighs_its_criteria_and_reports_each_as_a_metric() -> None:
    async def concise(answer: Message, task: Task) -> float:
        await asyncio.sleep(0)
        return 1.0 if len(answer.get("content") or "") <= 3 else 0.0

    rubric = Rubric([numeric_answer, concise], weights=[1.0, 0.5])
    (right_but_long,) = play(ToolEnv([add], reward_fn=rubric), reply("5.00000"))
    assert right_but_long.reward == 1.0
    assert right_but_long.metrics["rubric/numeric_answer"] == 1.0
    assert right_but_long.metrics["rubric/concise"] == 0.0
    (both,) = play(ToolEnv([add], reward_fn=rubric), reply("5"))
    assert both.reward == 1.5


def test_rubrics_refuse_unnamed_duplicates_and_mismatched_weights() -> None:
    with pytest.raises(ValueError, match="names must differ"):
        Rubric([exact_answer, exact_answer])
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        Rubric([exact_answer, numeric_answer], weights=[1.0])


def test_what_the_reward_function_raises_escapes_step_so_the_rollout_applies_env_errors() -> None:
    def unavailable(answer: Message, task: Task) -> float:
        raise ConnectionError("judge unreachable")

    with pytest.raises(ConnectionError, match="judge unreachable"):
        play(ToolEnv([add], reward_fn=unavailable), reply("5"))


class Notebook(ToolEnv):
    """Tools as methods: the notes live on the env, one env per episode."""

    def __init__(self) -> None:
        super().__init__([add], reward_fn=self.graded)
        self.notes: list[str] = []

    @function_tool
    def write(self, note: str) -> str:
        """Write a note down.

        Args:
            note: The note.
        """
        self.notes.append(note)
        return f"{len(self.notes)} note(s)"

    @function_tool
    async def read(self) -> list[str]:
        """Read every note written so far."""
        return self.notes

    def graded(self, answer: Message, task: Task) -> float:
        return float(task.target in self.notes)


def test_function_tool_methods_are_the_envs_tools_bound_to_each_episodes_env() -> None:
    first, second = Notebook(), Notebook()
    assert [spec["function"]["name"] for spec in first.tool_specs] == ["add", "write", "read"]
    assert first.tool_specs[1] == get_json_schema(Notebook.write.fn)
    wrote, read, answer = play(
        first, calls(("write", {"note": "5"})), calls(("read", {})), reply("5")
    )
    assert wrote.messages[-1]["content"] == "1 note(s)"
    assert read.messages[-1]["content"] == '["5"]'
    assert answer.reward == 1.0
    assert second.notes == []  # nothing leaks between episodes' envs


def test_a_subclass_overrides_the_opening_the_final_answer_rule_and_the_metrics() -> None:
    class Tagged(ToolEnv):
        def opening_messages(self, task: Task) -> list[Message]:
            return [Message(role="user", content=f"Q: {task.prompt} Answer in <answer> tags.")]

        def is_final_answer(self, message: Message) -> bool:
            return "<answer>" in (message.get("content") or "")

        async def score(self, answer: Message) -> tuple[float, dict[str, float]]:
            text = (answer.get("content") or "").split("<answer>")[-1].split("</answer>")[0]
            return float(text.strip() == self.task.target), {"answer_length": float(len(text))}

    thinking, answered = play(Tagged([add]), reply("let me think"), reply("<answer>5</answer>"))
    assert not (thinking.terminated or thinking.truncated)
    assert answered.terminated and answered.reward == 1.0
    assert answered.metrics["answer_length"] == 1.0


def test_a_tool_env_needs_a_reward_and_unique_tool_names() -> None:
    with pytest.raises(TypeError, match="pass reward_fn= or override score"):
        ToolEnv([add])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolEnv([add, add], reward_fn=exact_answer)
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(ToolEnv([add], reward_fn=exact_answer).step(reply("5")))


def test_check_env_passes_a_tool_env_with_function_and_method_tools() -> None:
    report = check_env(lambda task: Notebook(), [TASK, Task("What is 1 + 1?", "2")])
    assert report.ok and not report.warnings, report
