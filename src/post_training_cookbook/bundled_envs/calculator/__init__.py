"""The calculator environment: the docs' ``MathEnv`` example with bundled arithmetic tasks.

``MathEnv`` mirrors the documented "Write an environment" example (see ``env``), and
``CALCULATOR_TASKS`` holds 300 seeded arithmetic questions with integer answers: the first
250 are ``CALCULATOR_TRAIN_TASKS``, the last 50 ``CALCULATOR_VAL_TASKS`` (see ``tasks``)::

    train_multi_turn(config, tasks=list(CALCULATOR_TRAIN_TASKS),
                     env_factory=lambda task: MathEnv(), val_tasks=list(CALCULATOR_VAL_TASKS))
"""

from post_training_cookbook.bundled_envs.calculator.env import (
    SYSTEM_PROMPT,
    TOOL_ERROR_PREFIX,
    MathEnv,
)
from post_training_cookbook.bundled_envs.calculator.tasks import (
    CALCULATOR_TASKS,
    CALCULATOR_TRAIN_TASKS,
    CALCULATOR_VAL_TASKS,
    calculator_tasks,
)

__all__ = [
    "CALCULATOR_TASKS",
    "CALCULATOR_TRAIN_TASKS",
    "CALCULATOR_VAL_TASKS",
    "SYSTEM_PROMPT",
    "TOOL_ERROR_PREFIX",
    "MathEnv",
    "calculator_tasks",
]
