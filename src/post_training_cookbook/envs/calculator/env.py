"""``MathEnv``: the "Write an environment" example of the docs, packaged and ready to train.

It mirrors the documented example step for step: the same system prompt, one ``calculator``
tool, tool errors reported to the model as ``tool_error: {exc!r}`` tool messages, the episode
ending on the first reply without tool calls, and reward 1.0 iff that reply, stripped, equals
``str(task.target)``. Where it departs, and why:

- the tool is :class:`~post_training_cookbook.envs.arithmetic.CalculatorTool`, which fills in
  the example's ``safe_eval`` and prints numbers canonically (``6 / 3`` reads ``2``, not
  ``2.0``), so a model that copies the tool's answer matches an integer target;
- a reply whose ``content`` is missing or ``None`` scores 0.0 instead of raising;
- the final step's ``metrics`` count the episode's tool calls and tool errors;
- ``step`` before ``reset`` raises ``RuntimeError``.
"""

from __future__ import annotations

from post_training_cookbook.envs.arithmetic import CalculatorTool
from post_training_cookbook.envs.base import Env, StepResult, Task, Tool, tool_to_spec
from post_training_cookbook.types import Message, ToolCall, ToolSpec

SYSTEM_PROMPT = "Use the calculator tool, then reply with only the final number."

TOOL_ERROR_PREFIX = "tool_error: "


class MathEnv(Env):
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
            Message(role="system", content=SYSTEM_PROMPT),
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
