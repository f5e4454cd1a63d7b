"""``MathEnv``: the "Write an environment" example of the docs, packaged and ready to train.

It is the documented example on ``ToolEnv``, and behaves as it does: the same system prompt,
one ``calculator`` tool, tool errors reported to the model as ``tool_error: {exc!r}`` tool
messages, the episode ending on the first reply without tool calls, and reward 1.0 iff that
reply, stripped, equals ``str(task.target)`` (``exact_answer``). Where it departs, and why:

- the tool is :class:`~post_training_cookbook.envs.arithmetic.CalculatorTool`, which fills in
  the example's ``safe_eval`` and prints numbers canonically (``6 / 3`` reads ``2``, not
  ``2.0``), so a model that copies the tool's answer matches an integer target;
- a reply whose ``content`` is missing or ``None`` scores 0.0 instead of raising;
- a call to an unknown tool is answered with the tools there are
  (``tool_error: ValueError("unknown tool 'python'; available: calculator")``), where the
  example's ``KeyError('python')`` names only the wrong one;
- the final step's ``metrics`` count the episode's tool calls and tool errors;
- ``step`` before ``reset`` raises ``RuntimeError``.
"""

from __future__ import annotations

from post_training_cookbook.envs.arithmetic import CalculatorTool
from post_training_cookbook.envs.rewards import exact_answer
from post_training_cookbook.envs.tool_env import TOOL_ERROR_PREFIX, ToolEnv

SYSTEM_PROMPT = "Use the calculator tool, then reply with only the final number."

__all__ = ["SYSTEM_PROMPT", "TOOL_ERROR_PREFIX", "MathEnv"]


class MathEnv(ToolEnv):
    """One calculator episode: tool calls until a reply without one, scored against the target."""

    def __init__(self) -> None:
        super().__init__([CalculatorTool()], system_prompt=SYSTEM_PROMPT, reward_fn=exact_answer)

    def tool_error(self, exc: Exception) -> str:
        return f"{TOOL_ERROR_PREFIX}{exc!r}"  # the example's form: the exception's type shows

    def episode_metrics(self, reward: float) -> dict[str, float]:
        return {
            "correct": reward,
            "tool_calls": float(self.num_tool_calls),
            "tool_errors": float(self.num_tool_errors),
        }
