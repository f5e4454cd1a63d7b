"""The reference environment: a tool-use game over a fictional fact world.

``TOOL_USE_GAME_TASKS`` holds every task, train split first; ``TOOL_USE_GAME_TRAIN_TASKS`` and
``TOOL_USE_GAME_VAL_TASKS`` are the two splits (see ``world`` for how they are drawn: they
share no task and no entity). The bundled model was fine-tuned on the train split only.
"""

from post_training_cookbook.envs.tool_use_game.env import (
    SYSTEM_PROMPT,
    ToolUseGameEnv,
    default_world,
)
from post_training_cookbook.envs.tool_use_game.world import FactWorld, build_tasks, build_world

TOOL_USE_GAME_TRAIN_TASKS, TOOL_USE_GAME_VAL_TASKS = build_tasks(default_world())
TOOL_USE_GAME_TASKS = (*TOOL_USE_GAME_TRAIN_TASKS, *TOOL_USE_GAME_VAL_TASKS)

__all__ = [
    "SYSTEM_PROMPT",
    "TOOL_USE_GAME_TASKS",
    "TOOL_USE_GAME_TRAIN_TASKS",
    "TOOL_USE_GAME_VAL_TASKS",
    "FactWorld",
    "ToolUseGameEnv",
    "build_tasks",
    "build_world",
    "default_world",
]
