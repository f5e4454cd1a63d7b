"""Environments: tasks, tools and episodes (see ``base`` for the contract).

On top of the contract, the pieces an env is written with: ``function_tool`` (a typed,
documented function as a tool), ``ToolEnv`` (the tool-use episode loop, with its parts to
override), reward functions and ``Rubric`` (``rewards``), judge-model rewards (``judge``),
weighted mixtures of envs (``mixture``), the safe ``calculator`` tool (``arithmetic``) and
``check_env``; and the reference env, ``tool_use_game``, to copy from. Tools from MCP servers
and the code sandbox are in ``post_training_cookbook.tool_backends``, the other bundled envs
(calculator, BFCL) in ``post_training_cookbook.bundled_envs``.
"""

from post_training_cookbook.deprecation import moved_attribute
from post_training_cookbook.envs.arithmetic import safe_eval
from post_training_cookbook.envs.base import (
    Env,
    StepResult,
    Task,
    Tool,
    ToolBackendError,
    ToolResult,
    ToolWithSpec,
    tool_to_spec,
)
from post_training_cookbook.envs.checker import EnvCheckError, EnvCheckReport, check_env
from post_training_cookbook.envs.judge import JudgeError, JudgeReward, OpenAIJudge
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
    "ToolWithSpec",
    "check_env",
    "exact_answer",
    "function_tool",
    "numeric_answer",
    "safe_eval",
    "score_answer",
    "tool_to_spec",
]


def __getattr__(name: str) -> object:
    return moved_attribute(__name__, name)  # the MCP tools, LocalJudge: see moved_paths.py
