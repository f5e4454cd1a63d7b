"""``ToolUseGameEnv``: answer questions about a fictional world with three tools.

The reference environment, on ``ToolEnv``: the conversation, the dispatch of tool calls (errors
go back to the model as tool messages) and the endings are ``ToolEnv``'s: the episode ends when
the assistant replies without a tool call (graded), when a tool asks to stop (graded on that
message's content), or, truncated, after ``max_turns`` assistant turns. What is the game's own
is here: its tools, its system prompt, its grading and two metrics.
"""

from __future__ import annotations

from post_training_cookbook.envs.base import Tool
from post_training_cookbook.envs.rewards import numeric_answer
from post_training_cookbook.envs.tool_env import ToolEnv
from post_training_cookbook.envs.tool_use_game.tools import (
    GameCalculatorTool,
    ListFactKeysTool,
    LookupTool,
)
from post_training_cookbook.envs.tool_use_game.world import FactWorld, build_world

SYSTEM_PROMPT = (
    "Answer questions about a fictional world. Look facts up with the tools and use the "
    "calculator for arithmetic. Then reply with only the final number, rounded to two "
    "decimals if it is not whole."
)
DEFAULT_MAX_TURNS = 8
_DEFAULT_WORLD: FactWorld | None = None


def default_world() -> FactWorld:
    """The world the bundled tasks are built on (built once per process)."""
    global _DEFAULT_WORLD
    if _DEFAULT_WORLD is None:
        _DEFAULT_WORLD = build_world()
    return _DEFAULT_WORLD


class ToolUseGameEnv(ToolEnv):
    """The game's tools on ``ToolEnv``: graded by ``numeric_answer``, truncated after
    ``max_turns`` assistant turns; the final step adds ``correct`` and the task's ``level``."""

    def __init__(
        self,
        world: FactWorld | None = None,
        *,
        max_turns: int = DEFAULT_MAX_TURNS,
        extra_tools: list[Tool] | None = None,
    ) -> None:
        world = world if world is not None else default_world()
        tools: list[Tool] = [ListFactKeysTool(world), LookupTool(world), GameCalculatorTool()]
        super().__init__(
            [*tools, *(extra_tools or [])],
            system_prompt=SYSTEM_PROMPT,
            reward_fn=numeric_answer,
            max_turns=max_turns,
        )

    def episode_metrics(self, reward: float) -> dict[str, float]:
        level = float(self.task.metadata.get("level", 0))
        return {"correct": reward, **super().episode_metrics(reward), "level": level}
