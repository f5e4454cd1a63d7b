"""Environments: tasks, tools and episodes (see ``base`` for the contract)."""

from post_training_cookbook.envs.base import Env, StepResult, Task, Tool, ToolResult, tool_to_spec

__all__ = ["Env", "StepResult", "Task", "Tool", "ToolResult", "tool_to_spec"]
