"""``function_tool``: a typed, documented Python function as a ``Tool``.

Writing a tool class with a hand-written JSON schema repeats what the function already says.
TRL's ``tools=[fn]`` and chat templates derive the schema from the function's type hints and
its Google-style docstring with transformers' ``get_json_schema``; so does this, so a prompt
renders the tool exactly as those do::

    @function_tool
    def lookup(key: str) -> str:
        \"\"\"Look up the value of a fact by its key.

        Args:
            key: The fact's key, such as 'kalo.weight'.
        \"\"\"
        return str(FACTS[key])

``lookup`` is then a ``Tool`` (``name``, ``description``, ``parameters_schema``, ``execute``)
and still callable as a function. ``execute`` checks the model's arguments against the schema
before the function runs, so a function never sees a missing or mistyped argument; a bad call
raises ``ValueError`` with a message the model can act on, and the env (``ToolEnv``, or the
seed's ``except`` around ``execute``) reports it to the model. A sync function runs in a worker
thread (``asyncio.to_thread``), so a slow one does not stall the other episodes; an async one
is awaited.

Methods work too: ``@function_tool`` on a method of a ``ToolEnv`` subclass makes it one of
that env's tools, bound to the episode's env (TRL's ``environment_factory`` pattern: state
lives on the env, one env per episode).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Callable
from typing import Any, overload

from post_training_cookbook.envs.base import ToolResult
from post_training_cookbook.types import ToolSpec

MAX_ARGUMENTS_LENGTH = 65_536
"""Longest arguments string a function tool parses, in characters: model output is hostile
input, and parsing is the only cost paid before the schema check."""


class FunctionTool:
    """A ``Tool`` made from a function by ``function_tool``; calling it calls the function."""

    def __init__(
        self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
    ) -> None:
        from transformers.utils import get_json_schema

        try:
            spec: dict[str, Any] = get_json_schema(fn)
        except Exception as exc:  # TypeHintParsingException, DocstringParsingException
            raise TypeError(f"function_tool({_name_of(fn)}): {exc}") from exc
        function = spec["function"]
        if name is not None:
            function["name"] = name
        if description is not None:
            function["description"] = description
        if not function.get("description"):
            raise TypeError(
                f"function_tool({_name_of(fn)}): the docstring needs a description above Args"
            )
        self.fn = fn
        self.spec: ToolSpec = spec  # type: ignore[assignment]
        self.name: str = function["name"]
        self.description: str = function["description"]
        self.parameters_schema: dict[str, Any] = function["parameters"]
        # imported here: the envs package stays importable where only training runs
        from jsonschema.validators import validator_for

        self._validator = validator_for(self.parameters_schema)(self.parameters_schema)
        parameters = list(inspect.signature(fn).parameters.values())
        self.is_method = bool(parameters) and parameters[0].name in ("self", "cls")
        self._takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
        self._receiver: Any = None

    def __get__(self, instance: Any, owner: type | None = None) -> FunctionTool:
        """On an instance, the tool bound to it (a method's ``self``)."""
        if instance is None or not self.is_method:
            return self
        bound = copy.copy(self)
        bound._receiver = instance
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._receiver is not None:
            return self.fn(self._receiver, *args, **kwargs)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"function_tool({_name_of(self.fn)})"

    def parse_arguments(self, arguments: str) -> dict[str, Any]:
        """The model's arguments as keyword arguments, or ``ValueError`` saying what to fix."""
        if not isinstance(arguments, str):
            raise ValueError(f"{self.name}: arguments must be a JSON object encoded as a string")
        if len(arguments) > MAX_ARGUMENTS_LENGTH:
            raise ValueError(f"{self.name}: arguments too long (max {MAX_ARGUMENTS_LENGTH})")
        try:
            values = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            raise ValueError(f"{self.name}: arguments are not valid JSON ({reason})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{self.name}: arguments must be a JSON object, got {values!r:.80}")
        known = self.parameters_schema.get("properties", {})
        unknown = sorted(set(values) - set(known))
        if unknown and not self._takes_any_keyword:
            expected = ", ".join(known) or "none"
            raise ValueError(f"{self.name}: unknown argument(s) {unknown}; expected: {expected}")
        from jsonschema.exceptions import best_match

        error = best_match(self._validator.iter_errors(values))
        if error is not None:
            where = "/".join(map(str, error.absolute_path))
            at = f"argument '{where}': " if where else ""
            raise ValueError(f"{self.name}: {at}{error.message}")
        return values

    async def execute(self, arguments: str) -> ToolResult:
        """Check ``arguments`` against the schema, run the function, return its result as text.
        Whatever the function raises propagates: the env reports it to the model."""
        if self.is_method and self._receiver is None:
            raise TypeError(f"{self.name} is a method: use it through an instance of its class")
        values = self.parse_arguments(arguments)
        if inspect.iscoroutinefunction(self.fn):
            result = await self(**values)
        else:
            result = await asyncio.to_thread(self, **values)
            if inspect.isawaitable(result):  # a sync wrapper that returns a coroutine
                result = await result
        return as_tool_result(result)


@overload
def function_tool(fn: Callable[..., Any], /) -> FunctionTool: ...


@overload
def function_tool(
    *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """``fn`` as a ``Tool`` whose schema is ``get_json_schema(fn)``; a decorator too, with or
    without ``name``/``description`` overrides. ``TypeError`` at once when a parameter lacks
    a type hint or the docstring lacks a description (of the function or of an argument)."""
    if fn is None:
        return lambda inner: FunctionTool(inner, name=name, description=description)
    return FunctionTool(fn, name=name, description=description)


def as_tool(tool: Any) -> Any:
    """A ``Tool`` as it is; a plain function through ``function_tool`` (``tools=[fn]``)."""
    if isinstance(tool, FunctionTool) or all(
        hasattr(tool, attribute) for attribute in ("name", "parameters_schema", "execute")
    ):
        return tool
    if callable(tool):
        return FunctionTool(tool)
    raise TypeError(f"{tool!r} is neither a Tool nor a function")


def as_tool_result(value: Any) -> ToolResult:
    """What a function returned, as the text the model reads: strings as they are, ``None``
    as empty, JSON values as JSON, anything else by ``str``."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult(content=value)
    if value is None:
        return ToolResult(content="")
    try:
        return ToolResult(content=json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        return ToolResult(content=str(value))


def _name_of(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn)))
