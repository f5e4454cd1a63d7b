"""The tool-use game's three tools (post_training_cookbook.envs.tool_use_game) as one
taskset-scoped (shared) MCP toolset, advertised as the game advertises them: bare names
(``TOOL_PREFIX = None``: ``lookup``, not ``fact_tools_lookup``), in the game's order, with
its plain schemas (MCP's generated ones carry ``title`` fields and come sorted by name), the
format the bundled model was fine-tuned on. A bad call answers with a hint, as the game's
tools do, rather than raising: the model reads it as the result. The tools hold no state
and the world is fixed, so one server serves every rollout (started once by the worker),
rather than one per rollout as glossary's."""

import ast
import json
import operator
from pathlib import Path

import verifiers.v1 as vf
from mcp.types import Tool

WORLD = json.loads((Path(__file__).parent / "world.json").read_text())
FACTS: dict[str, int] = WORLD["facts"]
MAX_LISTED_KEYS = 10
MAX_EXPRESSION_LENGTH = 200
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv}  # fmt: skip


def string_schema(name: str) -> dict:
    return {"type": "object", "properties": {name: {"type": "string"}}, "required": [name]}


class FactTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None
    ADVERTISED = {"list_fact_keys": "prefix", "lookup": "key", "calculator": "expression"}
    """The game's order, each tool's one string argument."""

    def register(self, mcp) -> None:
        super().register(mcp)
        described = {name: getattr(self, name).__doc__.strip() for name in self.ADVERTISED}

        async def list_tools() -> list[Tool]:
            return [
                Tool(name=name, description=described[name], input_schema=string_schema(arg))
                for name, arg in self.ADVERTISED.items()
            ]

        mcp.list_tools = list_tools  # MCPServer's handler, as verifiers' NeMo-Gym toolset does

    @vf.tool
    def list_fact_keys(self, prefix: str) -> str:
        """List the fact keys that start with a prefix, such as an entity's name."""
        keys = sorted(key for key in FACTS if key.startswith(prefix.strip()))
        if not keys:
            return f"no keys start with '{prefix.strip()}'"
        more = len(keys) - MAX_LISTED_KEYS
        return ", ".join(keys[:MAX_LISTED_KEYS]) + (f" (and {more} more)" if more > 0 else "")

    @vf.tool
    def lookup(self, key: str) -> str:
        """Look up the value of a fact by its key, such as 'kalo.weight'."""
        if key.strip() not in FACTS:
            return (
                f"lookup: unknown key '{key.strip()}'; keys look like 'entity.attribute', "
                "call list_fact_keys with the entity's name to see them"
            )
        return str(FACTS[key.strip()])

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with numbers, + - * / and parentheses, such as 'a * (b + c)' with numbers in place of the letters."""
        try:
            return format_number(evaluate(expression))
        except (ValueError, ZeroDivisionError, SyntaxError, RecursionError) as error:
            return f"calculator: {error}"


def evaluate(expression: str) -> float:
    """+ - * / over numbers and parentheses; anything else is a ValueError."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"expression too long (max {MAX_EXPRESSION_LENGTH} characters)")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    return value(ast.parse(expression.strip(), mode="eval").body)


def format_number(number: float) -> str:
    if float(number).is_integer():
        return str(int(number))
    return f"{number:.6f}".rstrip("0").rstrip(".")


if __name__ == "__main__":
    FactTools.run()
