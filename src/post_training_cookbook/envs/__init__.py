"""Environments: tasks, tools and episodes (see ``base`` for the contract)."""

from post_training_cookbook.envs.arithmetic import safe_eval
from post_training_cookbook.envs.base import Env, StepResult, Task, Tool, ToolResult, tool_to_spec
from post_training_cookbook.envs.checker import EnvCheckError, EnvCheckReport, check_env

__all__ = [
    "Env",
    "EnvCheckError",
    "EnvCheckReport",
    "StepResult",
    "Task",
    "Tool",
    "ToolResult",
    "check_env",
    "safe_eval",
    "tool_to_spec",
]
