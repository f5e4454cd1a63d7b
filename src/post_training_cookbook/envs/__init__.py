"""Environments: tasks, tools and episodes (see ``base`` for the contract).

On top of the contract, the pieces an env is written with: ``function_tool`` (a typed,
documented function as a tool), ``ToolEnv`` (the tool-use episode loop, with its parts to
override), reward functions and ``Rubric`` (``rewards``), judge-model rewards (``judge``) and
weighted mixtures of envs (``mixture``), tools from MCP servers (``mcp_tools``) and the code
sandbox (``sandbox``).
"""

from post_training_cookbook.deprecation import moved_name
from post_training_cookbook.envs.arithmetic import safe_eval
from post_training_cookbook.envs.base import (
    Env,
    StepResult,
    Task,
    Tool,
    ToolBackendError,
    ToolResult,
    tool_to_spec,
)
from post_training_cookbook.envs.checker import EnvCheckError, EnvCheckReport, check_env
from post_training_cookbook.envs.judge import JudgeError, JudgeReward, OpenAIJudge
from post_training_cookbook.envs.mcp_connection import MCPHttpServer, MCPStdioServer
from post_training_cookbook.envs.mcp_tools import MCPTool, MCPToolbox, MCPToolCallError
from post_training_cookbook.envs.mixture import EnvMixture, MixtureEntry
from post_training_cookbook.envs.rewards import (
    RewardFn,
    Rubric,
    exact_answer,
    numeric_answer,
    score_answer,
)
from post_training_cookbook.envs.tool_env import ToolEnv
from post_training_cookbook.envs.tools import FunctionTool, function_tool

__all__ = [
    "Env",
    "EnvCheckError",
    "EnvCheckReport",
    "EnvMixture",
    "FunctionTool",
    "JudgeError",
    "JudgeReward",
    "MCPHttpServer",
    "MCPStdioServer",
    "MCPTool",
    "MCPToolCallError",
    "MCPToolbox",
    "MixtureEntry",
    "OpenAIJudge",
    "RewardFn",
    "Rubric",
    "StepResult",
    "Task",
    "Tool",
    "ToolBackendError",
    "ToolEnv",
    "ToolResult",
    "check_env",
    "exact_answer",
    "function_tool",
    "numeric_answer",
    "safe_eval",
    "score_answer",
    "tool_to_spec",
]


def __getattr__(name: str) -> object:
    if name == "LocalJudge":  # it loads a model, so it lives above the envs
        return moved_name(__name__, name, "post_training_cookbook.evaluation.local_judge")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
