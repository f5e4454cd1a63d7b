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
hosted guide's ``except`` around ``execute``) reports it to the model. A sync function runs in
a daemon thread of its own, so a slow one does not stall the other episodes and one that never
returns is left behind when the step times out (``envs/tool_calls.py``; ``isolated=True`` runs
each call in a child process that can be killed); an async one is awaited, and one that blocks
the event loop for more than ``MAX_BLOCKING_S`` (``time.sleep`` in an ``async def``) has its
call reported as a tool error naming the stall. What a function raises, ``SystemExit`` and
other ``BaseException`` s included, is a tool error, never the end of the run.

Methods work too: ``@function_tool`` on a method of a ``ToolEnv`` subclass makes it one of
that env's tools, bound to the episode's env (TRL's ``environment_factory`` pattern: state
lives on the env, one env per episode).
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import re
from collections.abc import Callable
from typing import Any, overload

from post_training_cookbook.envs.base import ToolResult
from post_training_cookbook.envs.tool_calls import (
    ToolCrashed,
    as_tool_result,
    crashed,
    importable_reference,
    in_child_process,
    in_daemon_thread,
    is_run_cancellation,
)
from post_training_cookbook.stretches import with_longest_stretch
from post_training_cookbook.types import ToolSpec

log = logging.getLogger(__name__)

MAX_ARGUMENTS_LENGTH = 65_536
"""Longest arguments string a function tool parses, in characters: model output is hostile
input, and parsing is the only cost paid before the schema check."""
MAX_BLOCKING_S = 1.0
"""Longest an async tool may run without yielding to the event loop (every other episode
waits meanwhile); a call that blocks longer is reported as a tool error naming the stall."""
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A tool name as the OpenAI API and chat templates take it."""


class FunctionTool:
    """A ``Tool`` made from a function by ``function_tool``; calling it calls the function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        isolated: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        from transformers.utils import get_json_schema

        _check_callable(fn, name, timeout_s)
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
        if not TOOL_NAME.match(self.name):
            raise TypeError(
                f"function_tool: name must be 1-64 letters, digits, '_' or '-', got {self.name!r}"
            )
        if timeout_s is not None and not isolated:
            raise TypeError(
                f"function_tool({self.name}): timeout_s needs isolated=True (a thread cannot "
                "be stopped; the env step's timeout bounds the others)"
            )
        self.description: str = function["description"]
        self.parameters_schema: dict[str, Any] = function["parameters"]
        # imported here: the envs package stays importable where only training runs
        from jsonschema.validators import validator_for

        self._validator = validator_for(self.parameters_schema)(self.parameters_schema)
        parameters = list(inspect.signature(fn).parameters.values())
        self.is_method = bool(parameters) and parameters[0].name in ("self", "cls")
        self._takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
        self._receiver: Any = None
        self.timeout_s = timeout_s
        self._reference = importable_reference(fn) if isolated else None
        if isolated and self.is_method:
            raise TypeError(
                f"function_tool({_name_of(fn)}): a method cannot be isolated (its env lives "
                "in this process); isolate a module-level function"
            )

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
        try:
            if self._reference is not None:
                call = in_child_process(self._reference, values, self.name, self.timeout_s)
                result = await call
            elif inspect.iscoroutinefunction(self.fn):
                result = await self._awaited(self(**values))
            else:
                result = await in_daemon_thread(lambda: self(**values), self.name)
                if inspect.isawaitable(result):  # a sync wrapper that returns a coroutine
                    result = await self._awaited(result)
        except Exception:
            raise
        except BaseException as exc:  # a tool's SystemExit is a tool error
            if is_run_cancellation(exc):
                raise
            raise crashed(self.name, exc) from None
        return as_tool_result(result, self.name)

    async def _awaited(self, awaitable: Any) -> Any:
        """``awaitable``'s value, or ``ToolCrashed`` when it blocked the loop too long."""
        value, longest_s = await with_longest_stretch(awaitable)
        if longest_s > MAX_BLOCKING_S:
            log.warning("async tool %s blocked the event loop for %.1fs", self.name, longest_s)
            raise ToolCrashed(
                f"{self.name} blocked the event loop for {longest_s:.1f}s (every episode "
                f"waited; the limit is {MAX_BLOCKING_S:g}s): await instead of blocking "
                "(asyncio.sleep, asyncio.to_thread for blocking work)"
            )
        return value


@overload
def function_tool(fn: Callable[..., Any], /) -> FunctionTool: ...


@overload
def function_tool(
    *,
    name: str | None = None,
    description: str | None = None,
    isolated: bool = False,
    timeout_s: float | None = None,
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    isolated: bool = False,
    timeout_s: float | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """``fn`` as a ``Tool`` whose schema is ``get_json_schema(fn)``; a decorator too, with or
    without ``name``/``description`` overrides. ``TypeError`` at once when a parameter lacks
    a type hint or the docstring lacks a description (of the function or of an argument),
    for ``*args``, generator functions and names that are not 1-64 letters, digits, ``_``
    or ``-``. ``isolated=True`` runs each call in a child process, killed when the call is
    cancelled (the step timeout) or runs past ``timeout_s``: for functions that may never
    return (``envs/tool_calls.py``)."""
    options = {"name": name, "description": description, "isolated": isolated}
    if fn is None:
        return lambda inner: FunctionTool(inner, **options, timeout_s=timeout_s)  # type: ignore[arg-type]
    return FunctionTool(fn, **options, timeout_s=timeout_s)  # type: ignore[arg-type]


def as_tool(tool: Any) -> Any:
    """A ``Tool`` as it is; a plain function through ``function_tool`` (``tools=[fn]``)."""
    if isinstance(tool, FunctionTool) or all(
        hasattr(tool, attribute) for attribute in ("name", "parameters_schema", "execute")
    ):
        return tool
    if callable(tool):
        return FunctionTool(tool)
    raise TypeError(f"{tool!r} is neither a Tool nor a function")


def _check_callable(fn: Any, name: Any, timeout_s: float | None) -> None:
    """``TypeError`` for what no schema or call can serve."""
    label = f"function_tool({_name_of(fn)})"
    if not callable(fn):
        raise TypeError(f"function_tool needs a function, got {type(fn).__name__}")
    if name is not None and (not isinstance(name, str) or not TOOL_NAME.match(name)):
        raise TypeError(f"{label}: name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"{label}: a generator function is no tool; return the result")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{label}: no signature to read ({exc})") from exc
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        raise TypeError(f"{label}: *args cannot be passed by a tool call (arguments are named)")
    if timeout_s is not None and not timeout_s > 0:
        raise TypeError(f"{label}: timeout_s must be > 0 or None, got {timeout_s!r}")


def _name_of(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn)))
