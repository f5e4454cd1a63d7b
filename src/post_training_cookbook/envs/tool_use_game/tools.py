"""The game's fact tools. Each raises ``ValueError`` with a hint the model can act on; the env
turns exceptions into tool messages, so a bad call never stops training."""

from __future__ import annotations

import json
from typing import Any

from post_training_cookbook.envs.arithmetic import CalculatorTool
from post_training_cookbook.envs.base import ToolResult
from post_training_cookbook.envs.tool_use_game.world import FactWorld

MAX_LISTED_KEYS = 10


def string_argument(arguments: str, name: str, tool: str) -> str:
    """The string argument ``name`` of a JSON-object ``arguments``, or a ``ValueError``."""
    try:
        parsed: Any = json.loads(arguments)
    except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise ValueError(f"{tool}: arguments are not valid JSON ({reason})") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get(name), str):
        raise ValueError(f'{tool}: expected arguments like {{"{name}": "..."}}')
    return str(parsed[name])


class ListFactKeysTool:
    name = "list_fact_keys"
    description = "List the fact keys that start with a prefix, such as an entity's name."
    parameters_schema = {
        "type": "object",
        "properties": {"prefix": {"type": "string"}},
        "required": ["prefix"],
    }

    def __init__(self, world: FactWorld) -> None:
        self._world = world

    async def execute(self, arguments: str) -> ToolResult:
        prefix = string_argument(arguments, "prefix", self.name).strip()
        keys = self._world.keys_with_prefix(prefix)
        if not keys:
            return ToolResult(content=f"no keys start with '{prefix}'")
        shown = ", ".join(keys[:MAX_LISTED_KEYS])
        more = len(keys) - MAX_LISTED_KEYS
        return ToolResult(content=shown + (f" (and {more} more)" if more > 0 else ""))


class LookupTool:
    name = "lookup"
    description = "Look up the value of a fact by its key, such as 'kalo.weight'."
    parameters_schema = {
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
    }

    def __init__(self, world: FactWorld) -> None:
        self._world = world

    async def execute(self, arguments: str) -> ToolResult:
        key = string_argument(arguments, "key", self.name).strip()
        if key not in self._world.facts:
            raise ValueError(
                f"lookup: unknown key '{key}'; keys look like 'entity.attribute', "
                "call list_fact_keys with the entity's name to see them"
            )
        return ToolResult(content=str(self._world.facts[key]))


class GameCalculatorTool(CalculatorTool):
    """The calculator, described without example numbers: in this game every number in the
    context should be one the episode produced (the question's, or a tool's result)."""

    description = (
        "Evaluate an arithmetic expression with numbers, + - * / and parentheses, such as "
        "'a * (b + c)' with numbers in place of the letters."
    )
    parameters_schema = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }
