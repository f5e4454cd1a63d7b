"""The tool-use game's env and the calculator's ``MathEnv`` as they were before ``ToolEnv``:
kept verbatim (class names aside, ``fmt: off``), so that ``test_tool_env_rewrites.py`` can check
that the envs rewritten on ``ToolEnv`` give the same messages, rewards and metrics on the same
scripted episodes. Not imported by the package.
"""

# fmt: off
# ruff: noqa
from __future__ import annotations

from post_training_cookbook.envs.arithmetic import CalculatorTool, numbers_equal
from post_training_cookbook.envs.base import Env, StepResult, Task, Tool, tool_to_spec
from post_training_cookbook.bundled_envs.calculator.env import SYSTEM_PROMPT as MATH_SYSTEM_PROMPT
from post_training_cookbook.envs.tool_use_game.env import (
    DEFAULT_MAX_TURNS,
    SYSTEM_PROMPT,
    default_world,
)
from post_training_cookbook.envs.tool_use_game.tools import (
    GameCalculatorTool,
    ListFactKeysTool,
    LookupTool,
)
from post_training_cookbook.envs.tool_use_game.world import FactWorld
from post_training_cookbook.types import Message, ToolCall, ToolSpec

TOOL_ERROR_PREFIX = "tool_error: "


class GameEnvBefore(Env):
    def __init__(
        self,
        world: FactWorld | None = None,
        *,
        max_turns: int = DEFAULT_MAX_TURNS,
        extra_tools: list[Tool] | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        world = world if world is not None else default_world()
        tools: list[Tool] = [ListFactKeysTool(world), LookupTool(world), GameCalculatorTool()]
        self._tools = {tool.name: tool for tool in [*tools, *(extra_tools or [])]}
        self._max_turns = max_turns
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._turns = self._tool_calls = self._tool_errors = 0

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._turns = self._tool_calls = self._tool_errors = 0
        self._messages = [
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=task.prompt),
        ]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._task is None:
            raise RuntimeError("ToolUseGameEnv.step called before reset")
        self._messages.append(message)
        self._turns += 1
        tool_calls = message.get("tool_calls") or []
        if not tool_calls:
            return self._finish(message, truncated=False)
        should_stop = False
        for call in tool_calls:
            should_stop |= await self._run_tool(call)
        if should_stop:
            return self._finish(message, truncated=False)
        if self._turns >= self._max_turns:
            return self._finish(None, truncated=True)
        return StepResult(terminated=False, truncated=False, messages=list(self._messages))

    async def _run_tool(self, call: ToolCall) -> bool:
        """Append the tool's message; True when the tool asked to end the episode."""
        name = call["function"]["name"]
        self._tool_calls += 1
        tool = self._tools.get(name)
        try:
            if tool is None:
                raise ValueError(f"unknown tool '{name}'; available: {', '.join(self._tools)}")
            result = await tool.execute(call["function"]["arguments"])
            content, should_stop = result.content, result.should_stop
        except Exception as exc:
            self._tool_errors += 1
            content, should_stop = f"tool_error: {exc}", False
        self._messages.append(
            Message(role="tool", content=content, tool_call_id=call["id"], name=name)
        )
        return should_stop

    def _finish(self, answer: Message | None, *, truncated: bool) -> StepResult:
        assert self._task is not None
        correct = answer is not None and numbers_equal(
            answer.get("content") or "", self._task.target
        )
        metrics = {
            "correct": float(correct),
            "num_tool_calls": float(self._tool_calls),
            "num_tool_errors": float(self._tool_errors),
            "num_turns": float(self._turns),
            "level": float(self._task.metadata.get("level", 0)),
        }
        return StepResult(
            terminated=not truncated,
            truncated=truncated,
            messages=list(self._messages),
            reward=1.0 if correct else 0.0,
            metrics=metrics,
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


class MathEnvBefore(Env):
    """One calculator episode: tool calls until a reply without one, scored against the target."""

    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._tools: dict[str, Tool] = {"calculator": CalculatorTool()}
        self._tool_calls = 0
        self._tool_errors = 0

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._messages = [
            Message(role="system", content=MATH_SYSTEM_PROMPT),
            Message(role="user", content=task.prompt),
        ]
        self._tool_calls = self._tool_errors = 0
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._task is None:
            raise RuntimeError("MathEnv.step() called before reset()")
        self._messages.append(message)
        tool_calls = message.get("tool_calls") or []
        if not tool_calls:
            # No tool calls: the message is the final answer.
            return self._final_answer(message.get("content") or "", self._task)
        for call in tool_calls:
            self._messages.append(await self._run(call))
        return StepResult(terminated=False, truncated=False, messages=list(self._messages))

    async def _run(self, call: ToolCall) -> Message:
        name = call["function"]["name"]
        self._tool_calls += 1
        try:
            result = await self._tools[name].execute(call["function"]["arguments"])
            content = result.content
        except Exception as exc:
            # Report a bad tool call to the model: an uncaught exception would stop the run.
            self._tool_errors += 1
            content = f"{TOOL_ERROR_PREFIX}{exc!r}"
        return Message(role="tool", content=content, tool_call_id=call["id"], name=name)

    def _final_answer(self, content: str, task: Task) -> StepResult:
        correct = content.strip() == str(task.target)
        return StepResult(
            terminated=True,
            truncated=False,
            messages=list(self._messages),
            reward=1.0 if correct else 0.0,
            metrics={
                "correct": float(correct),
                "tool_calls": float(self._tool_calls),
                "tool_errors": float(self._tool_errors),
            },
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)
