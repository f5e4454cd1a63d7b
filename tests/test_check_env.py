"""check_env: a conforming env passes, and each broken env gets its own readable error."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import jsonschema
import pytest

from post_training_cookbook.envs import (
    Env,
    EnvCheckError,
    EnvCheckReport,
    StepResult,
    Task,
    ToolResult,
    check_env,
    tool_to_spec,
)
from post_training_cookbook.envs.checker import (
    MALFORMED_ARGUMENTS,
    UNKNOWN_TOOL_NAME,
    _example_arguments,
    acheck_env,
)
from post_training_cookbook.types import Message, ToolCall, ToolSpec

TASKS = [
    Task(prompt="What is 2 + 3?", target="5"),
    Task(prompt="What is 10 + 7?", target="17"),
    Task(prompt="What is 1 + 1?", target="2"),
]
SCRIPT_COUNT = 8


ADD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


class AddTool:
    name = "add"
    description = "Add two integers."

    def __init__(self) -> None:
        self.parameters_schema = ADD_SCHEMA

    async def execute(self, arguments: str) -> ToolResult:
        values = json.loads(arguments)
        return ToolResult(content=str(values["a"] + values["b"]))


class AdderEnv(Env):
    """A conforming env like the hosted guide's MathEnv; the broken envs below override it."""

    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._task = Task(prompt="")
        self._tools = {"add": AddTool()}
        self.closed = False

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._messages = [
            Message(role="system", content="Use add, then reply with the number."),
            Message(role="user", content=task.prompt),
        ]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        tool_calls = message.get("tool_calls", [])
        if not tool_calls:
            return self._final(message)
        for call in tool_calls:
            self._messages.append(await self._answer(call))
        return StepResult(terminated=False, truncated=False, messages=list(self._messages))

    async def _answer(self, call: ToolCall) -> Message:
        name = call["function"]["name"]
        try:
            content = (await self._tools[name].execute(call["function"]["arguments"])).content
        except Exception as exc:
            content = f"tool_error: {exc!r}"
        return Message(role="tool", content=content, tool_call_id=call["id"], name=name)

    def _final(self, message: Message) -> StepResult:
        correct = message.get("content", "").strip() == self._task.target
        return StepResult(
            terminated=True,
            truncated=False,
            messages=list(self._messages),
            reward=1.0 if correct else 0.0,
            metrics={"turns": len(self._messages)},
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self.closed = True


def check(env_class: type[Env], **options: Any) -> EnvCheckReport:
    return check_env(lambda task: env_class(), TASKS, **options)


def the_one_error(report: EnvCheckReport) -> str:
    assert len(report.errors) == 1, str(report)
    return report.errors[0]


def test_a_conforming_tool_env_passes_with_no_errors_or_warnings() -> None:
    report = check(AdderEnv)
    assert report.ok, str(report)
    assert report.errors == [] and report.warnings == []
    assert report.episodes_run == SCRIPT_COUNT * len(TASKS)
    assert str(report) == f"check_env: 0 errors, 0 warnings in {SCRIPT_COUNT * 3} episodes"
    report.raise_if_failed()


def test_a_tool_less_single_turn_env_passes() -> None:
    class AnswerOnlyEnv(AdderEnv):
        @property
        def tool_specs(self) -> list[ToolSpec]:
            return []

    assert check(AnswerOnlyEnv).ok


def test_the_scripts_send_every_kind_of_tool_call_with_schema_valid_arguments() -> None:
    episodes: list[list[Message]] = []

    class RecordingEnv(AdderEnv):
        async def reset(self, task: Task) -> list[Message]:
            episodes.append([])
            return await super().reset(task)

        async def step(self, message: Message) -> StepResult:
            episodes[-1].append(message)
            return await super().step(message)

    check(RecordingEnv, num_tasks=1, max_turns=5)
    calls_by_episode = [[c for m in e for c in m.get("tool_calls", [])] for e in episodes]
    for calls in calls_by_episode:
        ids = [call["id"] for call in calls]
        assert len(ids) == len(set(ids)), "call ids repeat within an episode"
        assert all(call["type"] == "function" for call in calls)
    calls = [call for episode_calls in calls_by_episode for call in episode_calls]
    arguments_to_add = [c["function"]["arguments"] for c in calls if c["function"]["name"] == "add"]
    valid = [a for a in arguments_to_add if a != MALFORMED_ARGUMENTS]
    for arguments in valid:
        jsonschema.validate(json.loads(arguments), ADD_SCHEMA)
    assert MALFORMED_ARGUMENTS in arguments_to_add
    assert any(c["function"]["name"] == UNKNOWN_TOOL_NAME for c in calls)
    messages = [m for e in episodes for m in e]
    assert any(len(m.get("tool_calls", [])) >= 2 for m in messages)
    assert max(len(e) for e in episodes) == 5, "the many-turns script runs to max_turns"
    assert {"content": "5", "role": "assistant"} in messages


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}, None),
        ({"type": "object", "properties": {"q": {"type": "string"}}}, {}),
        (
            {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 3},
                    "x": {"type": ["null", "number"]},
                    "unit": {"enum": ["cm", "m"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "flag": {"type": "boolean"},
                    "inner": {
                        "type": "object",
                        "properties": {"k": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
                        "required": ["k"],
                    },
                },
                "required": ["n", "x", "unit", "tags", "flag", "inner"],
            },
            None,
        ),
    ],
)
def test_generated_arguments_fill_required_properties_and_satisfy_the_schema(
    schema: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    arguments = _example_arguments(schema)
    jsonschema.validate(arguments, schema)
    assert set(arguments) == set(schema.get("required", []))
    if expected is not None:
        assert arguments == expected


def test_step_raising_on_an_unknown_tool_is_an_error_that_says_it_stops_training() -> None:
    class RaisesOnUnknownToolEnv(AdderEnv):
        async def _answer(self, call: ToolCall) -> Message:
            tool = self._tools[call["function"]["name"]]  # KeyError escapes step
            result = await tool.execute(call["function"]["arguments"])
            return Message(role="tool", content=result.content, tool_call_id=call["id"], name="add")

    report = check(RaisesOnUnknownToolEnv)
    assert (
        f"[script 'unknown tool', turn 1]: step raised KeyError('{UNKNOWN_TOOL_NAME}'); an "
        "exception escaping step stops the training run — return a tool message instead"
    ) in report.errors
    # The malformed-arguments script makes execute raise too, outside any try.
    assert any(
        e.startswith("[script 'malformed arguments', turn 1]: step raised JSONDecodeError")
        for e in report.errors
    )
    assert not report.ok


def test_a_tool_message_without_tool_call_id_is_an_error() -> None:
    class NoToolCallIdEnv(AdderEnv):
        async def _answer(self, call: ToolCall) -> Message:
            return Message(role="tool", content="5", name=call["function"]["name"])

    report = check(NoToolCallIdEnv)
    assert report.errors == [
        "[script 'tool call', turn 1 (and 14 more)]: a call to 'add' got no tool message "
        "carrying its tool_call_id; every tool call needs exactly one",
        "[script 'tool call', turn 1 (and 15 more)]: a tool message has no tool_call_id; "
        "set it to the id of the call it answers",
        "[script 'unknown tool', turn 1]: a call to 'check_env_no_such_tool' got no tool "
        "message carrying its tool_call_id; every tool call needs exactly one",
    ]


def test_a_tool_message_without_name_is_only_a_warning() -> None:
    class NamelessToolMessageEnv(AdderEnv):
        async def _answer(self, call: ToolCall) -> Message:
            return Message(role="tool", content="5", tool_call_id=call["id"])

    report = check(NamelessToolMessageEnv)
    assert report.ok, str(report)
    assert (
        "[script 'tool call', turn 1 (and 14 more)]: the tool message answering a call to "
        "'add' has no name; set name='add' (chat templates that show tool names read it)"
    ) in report.warnings


def test_step_messages_that_differ_from_env_messages_are_an_error() -> None:
    class StaleResultEnv(AdderEnv):
        async def step(self, message: Message) -> StepResult:
            result = await super().step(message)
            result.messages = result.messages[:-1]
            return result

    assert the_one_error(check(StaleResultEnv)) == (
        "[script 'final answer', turn 1 (and 21 more)]: result.messages differs from "
        "env.messages (1 message short); both must be the whole conversation so far"
    )


def test_a_step_that_rewrites_earlier_history_is_an_error() -> None:
    class RewritingEnv(AdderEnv):
        async def step(self, message: Message) -> StepResult:
            self._messages[0] = Message(role="system", content="changed")
            return await super().step(message)

    assert any(
        "step changed messages already in the history; only append" in error
        for error in check(RewritingEnv).errors
    )


def test_a_nan_reward_is_an_error() -> None:
    class NanRewardEnv(AdderEnv):
        def _final(self, message: Message) -> StepResult:
            result = super()._final(message)
            result.reward = math.nan
            return result

    assert the_one_error(check(NanRewardEnv)) == (
        "[script 'final answer', turn 1 (and 5 more)]: reward is nan; "
        "it must be finite (one NaN or inf poisons the whole batch)"
    )


def test_a_bool_metric_is_an_error_but_an_int_metric_is_fine() -> None:
    class BoolMetricEnv(AdderEnv):
        def _final(self, message: Message) -> StepResult:
            result = super()._final(message)
            result.metrics = {"turns": 3, "solved": True}
            return result

    assert the_one_error(check(BoolMetricEnv)) == (
        "[script 'final answer', turn 1 (and 5 more)]: metrics['solved'] is True (bool); "
        "it must be a float (an int will do)"
    )


def test_terminated_and_truncated_both_true_is_an_error() -> None:
    class BothFlagsEnv(AdderEnv):
        def _final(self, message: Message) -> StepResult:
            result = super()._final(message)
            result.truncated = True
            return result

    assert any(
        "terminated and truncated are both True" in error for error in check(BothFlagsEnv).errors
    )


def test_a_final_answer_that_does_not_end_the_episode_is_a_warning_not_an_error() -> None:
    class NeverEndsEnv(AdderEnv):
        def _final(self, message: Message) -> StepResult:
            return StepResult(terminated=False, truncated=False, messages=list(self._messages))

    report = check(NeverEndsEnv)
    assert report.ok, str(report)
    assert report.warnings[0].startswith(
        "[script 'final answer', turn 1 (and 5 more)]: a final answer (an assistant message "
        "without tool calls) did not end the episode"
    )


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "integr"}}},
            "[tool_specs]: tool_specs[0] has function.parameters that is not a valid JSON "
            "Schema: 'integr' is not valid under any of the given schemas (at properties/a/type)",
        ),
        (
            {"type": "string"},
            "[tool_specs]: tool_specs[0] has function.parameters of type 'string'; "
            'it must be "type": "object" (the arguments are a JSON object)',
        ),
    ],
)
def test_a_bad_json_schema_in_tool_specs_is_an_error(
    parameters: dict[str, Any], expected: str
) -> None:
    class BadSchemaEnv(AdderEnv):
        @property
        def tool_specs(self) -> list[ToolSpec]:
            spec = tool_to_spec(AddTool())
            spec["function"]["parameters"] = parameters
            return [spec]

    assert the_one_error(check(BadSchemaEnv)) == expected


def test_tool_specs_with_repeated_names_or_missing_fields_are_errors() -> None:
    class SloppySpecsEnv(AdderEnv):
        @property
        def tool_specs(self) -> list[ToolSpec]:
            no_description: Any = {
                "type": "function",
                "function": {"name": "add", "parameters": {}},
            }
            return [tool_to_spec(AddTool()), no_description]

    report = check(SloppySpecsEnv)
    assert "[tool_specs]: tool_specs[1] has no function.description (a string)" in report.errors
    assert "[tool_specs]: tool names must be unique; repeated: add" in report.errors


def test_reset_returning_its_internal_list_is_an_aliasing_error() -> None:
    class AliasingResetEnv(AdderEnv):
        async def reset(self, task: Task) -> list[Message]:
            await super().reset(task)
            return self._messages

    assert the_one_error(check(AliasingResetEnv)) == (
        "[reset]: reset returned the env's own history list: appending to the returned list "
        "changed env.messages; return a copy (list(self._messages))"
    )


def test_a_close_that_fails_the_second_time_is_not_idempotent() -> None:
    class CloseOnceEnv(AdderEnv):
        async def close(self) -> None:
            if self.closed:
                raise RuntimeError("already closed")
            self.closed = True

    assert the_one_error(check(CloseOnceEnv)) == (
        "[close (and 1 more)]: a second close raised RuntimeError('already closed'); "
        "close is not idempotent; make later calls no-ops"
    )


def test_a_hung_step_times_out_with_an_error() -> None:
    class HungStepEnv(AdderEnv):
        async def step(self, message: Message) -> StepResult:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    report = check(HungStepEnv, num_tasks=1, step_timeout_s=0.05)
    assert (
        "[script 'final answer', turn 1 (and 6 more)]: step did not finish within "
        "step_timeout_s=0.05s; a hung step stalls the training run"
    ) in report.errors


def test_a_step_that_blocks_the_event_loop_past_the_timeout_is_an_error() -> None:
    class BlockingStepEnv(AdderEnv):
        async def step(self, message: Message) -> StepResult:
            if message["content"] == TASKS[0].target:
                time.sleep(0.08)  # blocks the loop, so the timeout cannot cancel it
            return await super().step(message)

    report = check_env(lambda task: BlockingStepEnv(), TASKS[:1], step_timeout_s=0.05)
    error = the_one_error(report)
    assert error.startswith(
        "[script 'final answer', turn 1 (and 4 more)]: step blocked the event loop for over "
        "step_timeout_s=0.05s without yielding (a blocking call in async code"
    )


def test_a_step_that_blocks_the_event_loop_under_the_timeout_gets_a_warning() -> None:
    class BlockingStepEnv(AdderEnv):
        async def step(self, message: Message) -> StepResult:
            if message["content"] == TASKS[0].target:
                time.sleep(0.3)  # every concurrent episode of a run would wait this long
            return await super().step(message)

    report = check_env(lambda task: BlockingStepEnv(), TASKS[:1], step_timeout_s=5.0)
    assert report.errors == []
    assert any("step blocked the event loop for over 0.25s" in w for w in report.warnings)


def test_an_env_class_passed_as_the_factory_is_an_error_that_shows_the_fix() -> None:
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv

    report = check_env(ToolUseGameEnv, TOOL_USE_GAME_TASKS[:1])
    assert any(
        "env_factory is the class ToolUseGameEnv itself" in error
        and "env_factory=lambda task: ToolUseGameEnv()" in error
        for error in report.errors
    )


def test_a_sync_step_is_an_error_that_says_to_use_async_def() -> None:
    class SyncStepEnv(AdderEnv):
        def step(self, message: Message) -> StepResult:  # type: ignore[override]
            return StepResult(terminated=True, truncated=False, messages=list(self._messages))

    report = check(SyncStepEnv)
    assert (
        "[script 'final answer', turn 1 (and 6 more)]: step returned a StepResult, not an "
        "awaitable; define it with async def"
    ) in report.errors


def test_a_violation_on_some_tasks_only_names_those_tasks() -> None:
    class PickyResetEnv(AdderEnv):
        async def reset(self, task: Task) -> list[Message]:
            if task.target == "17":
                raise ValueError("no teens")
            return await super().reset(task)

    assert the_one_error(check(PickyResetEnv)) == (
        "[reset, task 1]: reset raised ValueError('no teens'); "
        "an exception escaping reset stops the training run"
    )


def test_an_env_factory_that_raises_is_an_error() -> None:
    def factory(task: Task) -> Env:
        raise TypeError("MathEnv() takes no arguments")

    report = check_env(factory, TASKS)
    assert report.errors == [
        "[env_factory]: env_factory(task) raised TypeError('MathEnv() takes no arguments')"
    ]
    assert report.episodes_run == 0


def test_raise_if_failed_raises_an_assertion_error_carrying_the_report() -> None:
    class NanRewardEnv(AdderEnv):
        def _final(self, message: Message) -> StepResult:
            return StepResult(True, False, list(self._messages), reward=math.inf)

    report = check(NanRewardEnv, num_tasks=1)
    with pytest.raises(EnvCheckError) as raised:
        report.raise_if_failed()
    assert isinstance(raised.value, AssertionError)
    assert raised.value.report is report
    assert str(raised.value) == str(report)
    assert str(report).startswith("check_env: 1 error, 0 warnings in 8 episodes\n  ERROR [")


def test_check_env_runs_inside_a_running_event_loop_and_acheck_env_agrees() -> None:
    async def from_async_code() -> tuple[EnvCheckReport, EnvCheckReport]:
        from_sync = check_env(lambda task: AdderEnv(), TASKS)
        return from_sync, await acheck_env(lambda task: AdderEnv(), TASKS)

    from_sync, from_async = asyncio.run(from_async_code())
    assert from_sync == from_async
    assert from_sync.ok and from_sync.episodes_run == SCRIPT_COUNT * 3


@pytest.mark.parametrize("options", [{"num_tasks": 0}, {"max_turns": 0}, {"step_timeout_s": 0.0}])
def test_nonsense_options_raise_value_error(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        check(AdderEnv, **options)


def test_no_tasks_raise_value_error() -> None:
    with pytest.raises(ValueError, match="at least one task"):
        check_env(lambda task: AdderEnv(), [])


def test_the_bundled_calculator_env_passes_check_env() -> None:
    calculator = pytest.importorskip("post_training_cookbook.bundled_envs.calculator")
    report = check_env(lambda task: calculator.MathEnv(), calculator.CALCULATOR_TASKS)
    assert report.errors == [], str(report)


def test_the_bundled_tool_use_game_env_passes_check_env() -> None:
    game = pytest.importorskip("post_training_cookbook.envs.tool_use_game")
    report = check_env(lambda task: game.ToolUseGameEnv(), game.TOOL_USE_GAME_TASKS)
    assert report.errors == [], str(report)
