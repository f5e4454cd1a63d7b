"""``function_tool``: sync and async functions become tools whose schema is transformers'
``get_json_schema``; arguments are checked against it; sync functions run off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Literal

import pytest
from transformers.utils import get_json_schema

from post_training_cookbook.envs import (
    Env,
    FunctionTool,
    Task,
    Tool,
    ToolEnv,
    ToolResult,
    ToolWithSpec,
    check_env,
    exact_answer,
    function_tool,
    tool_to_spec,
)
from post_training_cookbook.types import Message


def convert(amount: float, unit: Literal["km", "mi"], digits: int = 2) -> str:
    """Convert a distance to kilometres.

    Args:
        amount: The distance.
        unit: The unit it is given in.
        digits: Decimal places of the result.

    Returns:
        The distance in kilometres.
    """
    factor = 1.0 if unit == "km" else 1.609344
    return f"{amount * factor:.{digits}f}"


async def fetch_weather(city: str, days: list[int] | None = None) -> dict[str, object]:
    """Look up the weather forecast of a city.

    Args:
        city: The city's name.
        days: Which days ahead to forecast (0 is today).
    """
    await asyncio.sleep(0)
    return {"city": city, "days": days or [0], "sky": "clear"}


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("fn", [convert, fetch_weather], ids=["sync", "async"])
def test_the_tools_schema_is_get_json_schemas(fn) -> None:
    tool = function_tool(fn)
    expected = get_json_schema(fn)
    assert tool_to_spec(tool) == expected
    assert tool.name == expected["function"]["name"]
    assert tool.description == expected["function"]["description"]
    assert tool.parameters_schema == expected["function"]["parameters"]
    assert isinstance(tool, Tool)  # the hosted guide's Tool protocol


def test_a_function_tool_carries_its_spec_and_an_env_offers_that_spec() -> None:
    """The spec is made once, when the tool is: ``ToolEnv.tool_specs`` hands on a copy of
    the one the tool carries (``return`` included), and changing the copy leaves the tool's."""
    tool = function_tool(convert)
    assert isinstance(tool, ToolWithSpec)
    assert tool.spec == get_json_schema(convert) and "return" in tool.spec["function"]
    (offered,) = ToolEnv([tool], reward_fn=exact_answer).tool_specs
    assert offered == tool.spec
    offered["function"]["name"] = "changed"
    assert tool.spec["function"]["name"] == "convert"


def test_a_carried_spec_is_offered_as_it_is_and_a_tool_without_one_gets_one_made() -> None:
    """Any tool with a ``spec`` (an MCP tool's is its server's listing) is offered that spec,
    with what name, description and parameters do not say (``strict``); a tool without one
    gets one made of them."""

    class Unlisted:
        name, description = "lookup", "Look a key up."
        parameters_schema = {"type": "object", "properties": {"key": {"type": "string"}}}

        async def execute(self, arguments: str) -> ToolResult:
            return ToolResult(content="")

    class Listed(Unlisted):
        spec = {
            "type": "function",
            "function": {
                "name": Unlisted.name,
                "description": Unlisted.description,
                "parameters": Unlisted.parameters_schema,
                "strict": True,
            },
        }

    assert tool_to_spec(Listed()) == Listed.spec
    made = tool_to_spec(Unlisted())
    assert not isinstance(Unlisted(), ToolWithSpec) and "strict" not in made["function"]
    assert made["function"]["parameters"] == Listed.parameters_schema


def test_a_sync_and_an_async_function_both_run_on_valid_arguments() -> None:
    converted = run(function_tool(convert).execute('{"amount": 10, "unit": "mi"}'))
    assert converted == ToolResult(content="16.09")
    weather = run(function_tool(fetch_weather).execute('{"city": "Oslo", "days": [1, 2]}'))
    assert json.loads(weather.content) == {"city": "Oslo", "days": [1, 2], "sky": "clear"}


def test_as_a_decorator_it_keeps_the_function_callable_and_takes_overrides() -> None:
    @function_tool(name="to_km", description="Distance in km.")
    def renamed(amount: float, unit: str) -> str:
        """Convert.

        Args:
            amount: The distance.
            unit: Its unit.
        """
        return convert(amount, "mi" if unit == "mi" else "km")

    assert isinstance(renamed, FunctionTool)
    assert renamed(1, "mi") == "1.61"
    spec = tool_to_spec(renamed)["function"]
    assert (spec["name"], spec["description"]) == ("to_km", "Distance in km.")
    assert function_tool(convert)(2, "km") == "2.00"


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ('{"unit": "km"}', "convert: 'amount' is a required property"),
        ('{"amount": "ten", "unit": "km"}', "convert: argument 'amount': 'ten' is not of type"),
        ('{"amount": 1, "unit": "parsec"}', "argument 'unit': 'parsec' is not one of ['km', 'mi']"),
        ('{"amount": 1, "unit": "km", "speed": 3}', "unknown argument(s) ['speed']; expected"),
        ('{"amount": 1, "unit": "km"', "convert: arguments are not valid JSON"),
        ("[1, 2]", "convert: arguments must be a JSON object"),
        ("[" * 10_000, "arguments are not valid JSON (nested too deeply)"),
        ("[" * 100_000, "convert: arguments too long (max 65536)"),
    ],
)
def test_arguments_that_break_the_schema_raise_a_value_error_before_the_function_runs(
    arguments: str, problem: str
) -> None:
    calls: list[object] = []

    def recorded(amount: float, unit: Literal["km", "mi"]) -> str:
        """Convert.

        Args:
            amount: The distance.
            unit: Its unit.
        """
        calls.append((amount, unit))
        return "ok"

    tool = function_tool(name="convert")(recorded)
    with pytest.raises(ValueError) as raised:
        run(tool.execute(arguments))
    assert problem in str(raised.value)
    assert not calls


def test_a_function_without_type_hints_or_descriptions_is_refused_when_decorated() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        """Does x.

        Args:
            x: A value.
        """

    def undocumented(x: int) -> int:
        """Does x."""
        return x

    with pytest.raises(TypeError, match="missing a type hint"):
        function_tool(untyped)
    with pytest.raises(TypeError, match="no description for the argument 'x'"):
        function_tool(undocumented)


def test_a_sync_function_runs_in_a_worker_thread_and_does_not_block_the_event_loop() -> None:
    threads: list[str] = []

    @function_tool
    def slow(seconds: float) -> str:
        """Wait, blocking.

        Args:
            seconds: How long.
        """
        threads.append(threading.current_thread().name)
        time.sleep(seconds)
        return "done"

    async def meanwhile() -> tuple[str, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        result = await slow.execute('{"seconds": 0.5}')
        ticker.cancel()
        return result.content, ticks

    content, ticks = run(meanwhile())
    assert content == "done"
    assert ticks >= 10  # the loop ran on while the function slept (50 ticks if nothing else)
    assert threads and threads[0] != threading.main_thread().name


def test_what_a_function_raises_reaches_the_model_as_a_tool_error_in_a_tool_env() -> None:
    @function_tool
    def divide(a: int, b: int) -> float:
        """Divide two integers.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b

    async def episode() -> list[Message]:
        env = ToolEnv([divide], reward_fn=exact_answer)
        await env.reset(Task("What is 1 / 0?", "none"))
        arguments = ['{"a": 1, "b": 0}', '{"a": 1}', '{"a": 6, "b": 4}']
        message = Message(
            role="assistant",
            content="",
            tool_calls=[
                {"id": f"c{i}", "type": "function", "function": {"name": "divide", "arguments": a}}
                for i, a in enumerate(arguments)
            ],
        )
        return (await env.step(message)).messages[-3:]

    zero, missing, good = run(episode())
    assert zero["content"] == "tool_error: division by zero"
    assert missing["content"] == "tool_error: divide: 'b' is a required property"
    assert good["content"] == "1.5"


def test_plain_functions_in_a_tool_env_are_made_into_tools_and_pass_check_env() -> None:
    env = ToolEnv([convert, fetch_weather], system_prompt="Help.", reward_fn=exact_answer)
    assert env.tool_specs == [get_json_schema(convert), get_json_schema(fetch_weather)]
    report = check_env(
        lambda task: ToolEnv([convert, fetch_weather], reward_fn=exact_answer),
        [Task("How far is 3 mi?", "4.83")],
    )
    assert report.ok, report


def test_a_function_tool_works_in_an_env_written_like_the_hosted_guides() -> None:
    """The hosted guide's dispatch (``await tool.execute(arguments)`` in ``try``) takes one too."""

    class GuideStyleEnv(Env):
        def __init__(self) -> None:
            self._messages: list[Message] = []
            self._tools = {"convert": function_tool(convert)}

        async def reset(self, task: Task) -> list[Message]:
            self._messages = [Message(role="user", content=task.prompt)]
            return list(self._messages)

        async def step(self, message: Message):  # type: ignore[no-untyped-def]
            from post_training_cookbook.envs import StepResult

            self._messages.append(message)
            for call in message.get("tool_calls", []):
                name = call["function"]["name"]
                try:
                    result = await self._tools[name].execute(call["function"]["arguments"])
                    content = result.content
                except Exception as exc:
                    content = f"tool_error: {exc!r}"
                self._messages.append(
                    Message(role="tool", content=content, tool_call_id=call["id"], name=name)
                )
            return StepResult(not message.get("tool_calls"), False, list(self._messages))

        @property
        def tool_specs(self):  # type: ignore[no-untyped-def]
            return [tool_to_spec(tool) for tool in self._tools.values()]

        @property
        def messages(self) -> list[Message]:
            return list(self._messages)

    report = check_env(lambda task: GuideStyleEnv(), [Task("How far is 3 mi?", "4.83")])
    assert report.ok, report
