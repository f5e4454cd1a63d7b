"""The packaged calculator environment: its bundled tasks and its episodes."""

from __future__ import annotations

import asyncio
import json

import pytest

from post_training_cookbook.bundled_envs.calculator import (
    CALCULATOR_TASKS,
    CALCULATOR_TRAIN_TASKS,
    CALCULATOR_VAL_TASKS,
    MathEnv,
    calculator_tasks,
)
from post_training_cookbook.envs import StepResult, Task, tool_to_spec
from post_training_cookbook.envs.arithmetic import CalculatorTool, format_number, safe_eval
from post_training_cookbook.types import FunctionCall, Message, ToolCall


def tool_call(expression: str, call_id: str = "call_0") -> Message:
    function = FunctionCall(name="calculator", arguments=json.dumps({"expression": expression}))
    return Message(
        role="assistant",
        content="",
        tool_calls=[ToolCall(id=call_id, type="function", function=function)],
    )


def play(task: Task, *script: Message) -> list[StepResult]:
    async def episode() -> list[StepResult]:
        env = MathEnv()
        await env.reset(task)
        return [await env.step(message) for message in script]

    return asyncio.run(episode())


# --- tasks ---------------------------------------------------------------------------------


def test_bundled_tasks_are_the_same_in_every_process() -> None:
    # Pinned: a change to the generator or its seed changes the benchmark, so it must be deliberate.
    assert [task.prompt for task in CALCULATOR_TASKS[:3]] == [
        "What is 93 ** 2 - 105?",
        "What is 345 + 2382 + 7037?",
        "What is 30 ** 2 + 935?",
    ]
    assert calculator_tasks() == list(CALCULATOR_TASKS)


def test_another_seed_gives_other_tasks() -> None:
    assert calculator_tasks(seed=1) != list(CALCULATOR_TASKS)
    assert calculator_tasks(seed=1) == calculator_tasks(seed=1)


def test_train_and_val_split_the_bundled_tasks_without_overlap() -> None:
    assert (len(CALCULATOR_TRAIN_TASKS), len(CALCULATOR_VAL_TASKS)) == (250, 50)
    assert CALCULATOR_TRAIN_TASKS + CALCULATOR_VAL_TASKS == CALCULATOR_TASKS
    assert {task.metadata["split"] for task in CALCULATOR_TRAIN_TASKS} == {"train"}
    assert {task.metadata["split"] for task in CALCULATOR_VAL_TASKS} == {"val"}
    expressions = [task.metadata["expression"] for task in CALCULATOR_TASKS]
    assert len(set(expressions)) == len(expressions)


def test_every_target_is_the_integer_safe_eval_gives_for_the_expression() -> None:
    for task in CALCULATOR_TASKS:
        expression = task.metadata["expression"]
        assert task.prompt == f"What is {expression}?"
        assert task.target == format_number(safe_eval(expression))
        assert task.target == str(int(task.target))


def test_bundled_tasks_have_varied_answers_and_operators() -> None:
    assert len({task.target for task in CALCULATOR_TASKS}) >= 250
    for symbol in ("+", "-", "*", "/", "**", "("):
        assert any(symbol in task.metadata["expression"] for task in CALCULATOR_TASKS), symbol


def test_task_counts_set_the_split_sizes() -> None:
    tasks = calculator_tasks(num_train=7, num_val=3)
    assert [task.metadata["split"] for task in tasks] == ["train"] * 7 + ["val"] * 3


def test_negative_task_counts_raise_value_error() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        calculator_tasks(num_train=-1)


# --- episodes ------------------------------------------------------------------------------


async def oracle_episode(task: Task) -> StepResult:
    """Call the calculator on the task's expression, then reply with what it said."""
    env = MathEnv()
    await env.reset(task)
    calculated = await env.step(tool_call(task.metadata["expression"]))
    return await env.step(_answer(calculated.messages[-1].get("content", "")))


def test_an_oracle_that_copies_the_tool_answer_solves_every_task() -> None:
    for task in CALCULATOR_TASKS:
        final = asyncio.run(oracle_episode(task))
        assert final.terminated and final.reward == 1.0, task


def _answer(content: str) -> Message:
    return Message(role="assistant", content=content)


def test_the_final_step_reports_tool_calls_and_tool_errors() -> None:
    task = CALCULATOR_TASKS[0]
    *_, final = play(
        task, tool_call("1 / 0", "a"), tool_call(task.metadata["expression"], "b"), _answer("0")
    )
    assert final.reward == 0.0
    assert final.metrics == {"correct": 0.0, "tool_calls": 2.0, "tool_errors": 1.0}


def test_a_tool_error_names_the_problem_for_the_model() -> None:
    (step,) = play(CALCULATOR_TASKS[0], tool_call("2 ** 1000"))
    assert step.messages[-1].get("content") == (
        "tool_error: ValueError('calculator: exponent too large (max 100)')"
    )


def test_a_final_reply_without_content_scores_zero() -> None:
    (final,) = play(CALCULATOR_TASKS[0], Message(role="assistant"))
    assert (final.terminated, final.reward) == (True, 0.0)


def test_the_env_offers_the_calculator_tool() -> None:
    assert MathEnv().tool_specs == [tool_to_spec(CalculatorTool())]


def test_step_before_reset_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(MathEnv().step(_answer("1")))


def test_messages_returns_a_copy_of_the_conversation() -> None:
    async def episode() -> None:
        env = MathEnv()
        await env.reset(CALCULATOR_TASKS[0])
        env.messages.append(_answer("injected"))
        assert [m["role"] for m in env.messages] == ["system", "user"]

    asyncio.run(episode())
