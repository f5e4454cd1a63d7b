"""The environment contract: what the training loop needs from a task, a tool and an env.

The env owns the conversation history, tool dispatch and the rule for when an episode
ends; the loop owns tokenization and sampling. One episode:

    messages = await env.reset(task)
    while True:
        message = <the policy samples one assistant message>
        result = await env.step(message)
        if result.terminated or result.truncated:
            break
    await env.close()

The final ``StepResult``'s ``reward`` is the episode's and its ``metrics`` are the episode's
metrics. Every step's ``reward`` is kept too (``Episode.turn_rewards``): training reads it
with ``turn_rewards="per_step"`` (each turn credited with its return), not by default.
"""

from __future__ import annotations

import abc
import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from post_training_cookbook.types import Message, ToolSpec


@dataclass(frozen=True)
class Task:
    """The spec of one episode: what the user asks, the expected answer, and anything else."""

    prompt: str
    target: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns. ``should_stop`` asks the env to end the episode; the env decides.
    ``structured_content``: the result as data, when the tool gives one (an MCP tool's
    ``structuredContent``); the model reads ``content``."""

    content: str
    should_stop: bool = False
    structured_content: Any = None


class ToolBackendError(RuntimeError):
    """What a tool raises when what it runs on failed (an MCP server that died or did not
    answer, a sandbox that could not start), not the call: ``ToolEnv`` does not report it
    to the model but lets it out of ``step``, so the rollout makes it an env error under
    ``env_errors``."""


@dataclass
class StepResult:
    """What ``Env.step`` returns.

    ``terminated``: task logic ended the episode (e.g. a final answer).
    ``truncated``: it was cut short for another reason (e.g. the env's own turn limit).
    ``reward``: this step's own reward (not a running total). The step that ends the episode
    gives the episode's reward; earlier steps' rewards count only with
    ``turn_rewards="per_step"``. ``metrics`` are read from the step that ends the episode.
    """

    terminated: bool
    truncated: bool
    messages: list[Message]
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """Anything with a name, a description, a JSON schema for its arguments and ``execute``."""

    name: str
    description: str
    parameters_schema: dict[str, Any]

    async def execute(self, arguments: str) -> ToolResult:
        """Run the tool on its arguments, a JSON object encoded as a string."""
        ...


UnparsedReplies = Literal["end_episode", "as_text"]


class Env(abc.ABC):
    """One episode of a multi-turn conversation with tools. Build a fresh env per episode."""

    unparsed_replies: ClassVar[UnparsedReplies] = "end_episode"
    """What a reply the codec cannot parse (a malformed tool call) does. ``"end_episode"``:
    the rollout ends the episode (``PARSE_FAILURE``, reward ``failed_parse_reward``).
    ``"as_text"``: ``step`` gets an assistant message holding the reply's text and no tool
    calls, for an env whose benchmark reads such a reply as one that calls nothing (BFCL's
    inference loop ends the user's turn). Counted in ``parse_rate`` either way."""

    @abc.abstractmethod
    async def reset(self, task: Task) -> list[Message]:
        """Start an episode on ``task``; return the opening messages (system, user, ...)."""

    @abc.abstractmethod
    async def step(self, message: Message) -> StepResult:
        """Take the assistant message, run its tool calls, say whether the episode ended."""

    @property
    @abc.abstractmethod
    def tool_specs(self) -> list[ToolSpec]:
        """The tools the chat template renders into the prompt."""

    @property
    @abc.abstractmethod
    def messages(self) -> list[Message]:
        """The conversation so far."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what ``reset`` started. Called once per episode end, for every cause."""


class RecordingEnv(Env):
    """An ``Env`` that keeps the tools it shows in ``_tools`` and the conversation in
    ``_messages``; ``tool_specs`` and ``messages`` hand out copies of them."""

    _tools: list[ToolSpec]
    _messages: list[Message]

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return list(self._tools)

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


EnvFactory = Callable[[Task], Env]
"""Builds a fresh env for each episode of a task: ``env_factory(task)``."""


def env_class_parameters(env_factory: object) -> list[inspect.Parameter] | None:
    """The constructor's parameters when ``env_factory`` is an ``Env`` class itself rather
    than a factory (``env_factory(task)`` then hands the task to the first of them); None for
    anything else, or a class whose signature cannot be read."""
    if not (inspect.isclass(env_factory) and issubclass(env_factory, Env)):
        return None
    try:
        return list(inspect.signature(env_factory).parameters.values())
    except (TypeError, ValueError):
        return None


@runtime_checkable
class ToolWithSpec(Tool, Protocol):
    """A ``Tool`` that carries the spec the model sees, made once when the tool was: a
    ``FunctionTool``'s is what transformers' ``get_json_schema`` made of its function (with
    ``return`` when the function declares one), an ``MCPTool``'s is its server's listing."""

    spec: ToolSpec


def tool_to_spec(tool: Tool) -> ToolSpec:
    """The OpenAI function-tool schema of ``tool``, as a prompt renders it: a copy of the one
    it carries (``ToolWithSpec``), else made of its name, description and parameters."""
    if isinstance(tool, ToolWithSpec):
        return copy.deepcopy(tool.spec)
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters_schema,
        },
    }
