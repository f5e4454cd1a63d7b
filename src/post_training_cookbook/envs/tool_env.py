"""``ToolEnv``: the tool-use episode every env writes by hand, written once.

The hosted guide's ``MathEnv`` spends 60 lines on a loop every tool env repeats: open with a system
prompt and the task, run each tool call and answer it with a tool message, turn a tool's
exception into a message the model reads, end on the first reply without a tool call and score
it. ``ToolEnv`` is that loop with its parts as arguments — tools, a system prompt, a reward
function of (final message, task), limits on tool calls and turns — and as methods a subclass
overrides where its env differs::

    env = ToolEnv([calculator], system_prompt="Use the calculator.", reward_fn=exact_answer)

An episode ends
- terminated, scored by ``reward_fn``: on a final answer (``is_final_answer``: a reply
  without tool calls), or after a tool whose result has ``should_stop`` (graded on the
  message that called it);
- truncated, reward 0.0: after ``max_turns`` assistant turns, or on a message whose calls
  would take the episode past ``max_tool_calls`` (those calls do not run).

The final step's metrics count the episode's tool calls, tool errors and turns, plus what the
reward function reports (a ``Rubric``'s criteria). What ``reward_fn`` raises (a judge that
cannot answer), and a tool's ``ToolBackendError`` (its server died), escape ``step``: the
rollout makes them env errors, under ``env_errors``.

Tools are ``Tool`` objects or plain typed, documented functions (made into tools by
``function_tool``), plus the env's own ``@function_tool`` methods, bound to the episode's env.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from post_training_cookbook.envs.base import (
    Env,
    StepResult,
    Task,
    Tool,
    ToolBackendError,
    tool_to_spec,
)
from post_training_cookbook.envs.rewards import RewardFn, score_answer
from post_training_cookbook.envs.tool_calls import crashed, is_run_cancellation
from post_training_cookbook.envs.tools import FunctionTool, as_tool
from post_training_cookbook.types import Message, ToolCall, ToolSpec

TOOL_ERROR_PREFIX = "tool_error: "


class ToolEnv(Env):
    """One tool-use episode: tool calls until a final answer, scored by ``reward_fn``."""

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        *,
        system_prompt: str | None = None,
        reward_fn: RewardFn | None = None,
        max_tool_calls: int | None = None,
        max_turns: int | None = None,
    ) -> None:
        if max_tool_calls is not None and max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0 or None, got {max_tool_calls}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or None, got {max_turns}")
        if reward_fn is None and type(self).score is ToolEnv.score:
            raise TypeError(f"{type(self).__name__}: pass reward_fn= or override score()")
        self.system_prompt = system_prompt
        self.reward_fn = reward_fn
        self.max_tool_calls = max_tool_calls
        self.max_turns = max_turns
        self.tools: dict[str, Tool] = {}
        for tool in [*map(as_tool, tools), *_method_tools(self)]:
            if tool.name in self.tools:
                raise ValueError(f"{type(self).__name__}: two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self._messages: list[Message] = []
        self._task: Task | None = None
        self.num_turns = self.num_tool_calls = self.num_tool_errors = 0

    # ---------------------------------------------------------------- the Env contract

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self.num_turns = self.num_tool_calls = self.num_tool_errors = 0
        self._messages = self.opening_messages(task)
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self.task  # noqa: B018 - raises before reset
        self._messages.append(message)
        self.num_turns += 1
        if self.is_final_answer(message):
            return await self.finish(message)
        calls = message.get("tool_calls") or []
        limit = self.max_tool_calls
        if limit is not None and self.num_tool_calls + len(calls) > limit:
            return await self.finish(None)
        should_stop = False
        for call in calls:
            should_stop |= await self.run_tool(call)
        if should_stop:
            return await self.finish(message)
        if self.max_turns is not None and self.num_turns >= self.max_turns:
            return await self.finish(None)
        return StepResult(terminated=False, truncated=False, messages=list(self._messages))

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self.tools.values()]

    async def close(self) -> None:
        """Close the tools that hold something for the episode (an async ``close``: a
        sandbox's scratch folder, an MCP server started for the episode)."""
        for tool in self.tools.values():
            close = getattr(tool, "close", None)
            if inspect.iscoroutinefunction(close):
                await close()

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    # ---------------------------------------------------------------- the parts to override

    @property
    def task(self) -> Task:
        """The episode's task; ``RuntimeError`` before ``reset``."""
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        return self._task

    def opening_messages(self, task: Task) -> list[Message]:
        """The system prompt (when there is one) and the task's prompt as the user's."""
        system = (
            []
            if self.system_prompt is None
            else [Message(role="system", content=self.system_prompt)]
        )
        return [*system, Message(role="user", content=task.prompt)]

    def is_final_answer(self, message: Message) -> bool:
        """Whether ``message`` ends the episode as the answer: here, one without tool calls."""
        return not message.get("tool_calls")

    async def run_tool(self, call: ToolCall) -> bool:
        """Run one call and append its tool message; True when the tool asked to stop."""
        name = call["function"]["name"]
        self.num_tool_calls += 1
        try:
            tool = self.tools.get(name)
            if tool is None:
                raise ValueError(f"unknown tool '{name}'; available: {', '.join(self.tools)}")
            result = await tool.execute(call["function"]["arguments"])
            content, should_stop = result.content, result.should_stop
        except ToolBackendError:
            raise  # not the call's fault: an env error, under the run's env_errors
        except BaseException as exc:  # a tool's SystemExit too; the run's cancellation not
            if is_run_cancellation(exc):
                raise
            self.num_tool_errors += 1
            error = exc if isinstance(exc, Exception) else crashed(name, exc)
            content, should_stop = self.tool_error(error), False
        self._messages.append(
            Message(role="tool", content=content, tool_call_id=call["id"], name=name)
        )
        return should_stop

    def tool_error(self, exc: Exception) -> str:
        """The tool message a failed call gets: the model reads it and can fix the call."""
        return f"{TOOL_ERROR_PREFIX}{exc}"

    async def finish(self, answer: Message | None) -> StepResult:
        """The final step: terminated and scored on ``answer``, or truncated (``None``)."""
        reward, reward_metrics = (0.0, {}) if answer is None else await self.score(answer)
        return StepResult(
            terminated=answer is not None,
            truncated=answer is None,
            messages=list(self._messages),
            reward=reward,
            metrics={**self.episode_metrics(reward), **reward_metrics},
        )

    async def score(self, answer: Message) -> tuple[float, dict[str, float]]:
        """The reward of ``answer`` and the metrics the reward function reports."""
        assert self.reward_fn is not None
        return await score_answer(self.reward_fn, answer, self.task)

    def episode_metrics(self, reward: float) -> dict[str, float]:
        """The final step's own metrics (the reward function's come on top)."""
        return {
            "num_tool_calls": float(self.num_tool_calls),
            "num_tool_errors": float(self.num_tool_errors),
            "num_turns": float(self.num_turns),
        }


def _method_tools(env: ToolEnv) -> list[Tool]:
    """The ``@function_tool`` attributes of the env's class and its bases, in definition order,
    bound to ``env``; a subclass's tool replaces a base's of the same attribute name."""
    found: dict[str, FunctionTool] = {}
    for klass in reversed(type(env).__mro__):
        for attribute, value in vars(klass).items():
            if isinstance(value, FunctionTool):
                found[attribute] = value
    return [tool.__get__(env, type(env)) for tool in found.values()]
