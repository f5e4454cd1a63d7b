r"""Tool calls in the XML format of Qwen3.5, Qwen3.6 and Qwen3.8, rendered and parsed.

One call renders as::

    <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>

A string value is printed verbatim, so ``"42"`` and ``42`` look the same; only the tool's JSON
schema can tell them apart. So ``parse_xml_calls`` types each value by the schema of the tool
it calls: a parameter typed ``string`` keeps its text verbatim, other types are read as JSON
(and the Python spellings ``True``/``False``/``None`` that Qwen3.5's template prints for
booleans and null). A call to a tool or parameter the schema does not know is a parse error.
Without tool schemas every value that reads as JSON is taken as JSON (a guess, flagged in
``Codec.parse``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from post_training_cookbook.codecs.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParseError,
    arguments_object,
    dump_json,
    make_tool_call,
)
from post_training_cookbook.types import ToolCall, ToolSpec

ValueStyle = Literal["python", "json"]
"""How a non-string value is printed: ``python`` (Qwen3.5: Jinja's ``string`` filter for
scalars, so ``True``/``None``; JSON for lists and objects) or ``json`` (Qwen3.6 and 3.8)."""

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>(?=\s*(?:<parameter=|$))", re.S)
_PYTHON_LITERALS: dict[str, tuple[str, Any]] = {
    "True": ("boolean", True),
    "False": ("boolean", False),
    "None": ("null", None),
}


def render_value(value: Any, style: ValueStyle) -> str:
    """One parameter value as the template prints it."""
    if isinstance(value, str):
        return value
    if style == "json" or isinstance(value, dict | list):
        return dump_json(value)
    return str(value)  # Jinja's ``string`` filter: True, None, 1.5


def render_xml_call(call: ToolCall, style: ValueStyle) -> str:
    """One ``<tool_call>`` block, parameters in the arguments' own order."""
    function = call["function"]
    parameters = "".join(
        f"<parameter={key}>\n{render_value(value, style)}\n</parameter>\n"
        for key, value in arguments_object(function["arguments"]).items()
    )
    return f"<tool_call>\n<function={function['name']}>\n{parameters}</function>\n</tool_call>"


def render_xml_calls(calls: list[ToolCall], content: str, style: ValueStyle) -> str:
    """An assistant turn's calls: a blank line after content, one newline between calls."""
    return "".join(
        ("\n" if number else "\n\n" if content.strip() else "") + render_xml_call(call, style)
        for number, call in enumerate(calls)
    )


def parse_xml_calls(text: str, tools: list[ToolSpec] | None) -> tuple[str, list[ToolCall]]:
    """The text outside ``<tool_call>`` blocks (stripped) and the calls inside them, in order."""
    schemas = _parameter_schemas(tools) if tools is not None else None
    calls = [
        _parse_block(match.group(1), schemas, f"tool call {number}")
        for number, match in enumerate(_BLOCK.finditer(text), start=1)
    ]
    rest = _BLOCK.sub("", text)
    if TOOL_CALL_OPEN in rest:
        raise ParseError(f"unterminated {TOOL_CALL_OPEN} tag")
    if TOOL_CALL_CLOSE in rest:
        raise ParseError(f"{TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}")
    if "<function=" in rest:
        raise ParseError(f"a <function=...> block outside {TOOL_CALL_OPEN} tags")
    return rest.strip(), calls


def _parse_block(
    body: str, schemas: dict[str, dict[str, Any] | None] | None, where: str
) -> ToolCall:
    function = _FUNCTION.fullmatch(body)
    if function is None:
        raise ParseError(f"{where}: expected <function=NAME>...</function> inside the tags")
    name, inner = function.group(1), function.group(2)
    if schemas is not None and name not in schemas:
        raise ParseError(f"{where}: unknown tool {name!r}; known: {sorted(schemas)}")
    properties = schemas.get(name) if schemas is not None else None
    arguments: dict[str, Any] = {}
    position = 0
    for match in _PARAMETER.finditer(inner):
        if match.start() != position:
            break
        key, raw = match.group(1), _one_newline_off(match.group(2))
        if key in arguments:
            raise ParseError(f"{where}: parameter {key!r} given twice")
        arguments[key] = _typed_value(raw, key, name, properties, schemas is not None, where)
        position = match.end()
    if inner[position:].strip():
        raise ParseError(f"{where}: malformed <parameter=...> block in {name!r}")
    return make_tool_call(name, arguments)


def _one_newline_off(raw: str) -> str:
    """The value between the tags without the one newline the template puts on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _typed_value(
    raw: str,
    key: str,
    name: str,
    properties: dict[str, Any] | None,
    have_schemas: bool,
    where: str,
) -> Any:
    if properties is None:
        if have_schemas:  # the tool declares no properties at all
            raise ParseError(f"{where}: unknown parameter {key!r} of {name!r}")
        return _json_or_text(raw)
    if key not in properties:
        raise ParseError(
            f"{where}: unknown parameter {key!r} of {name!r}; known: {sorted(properties)}"
        )
    types = schema_types(properties[key])
    if not types:
        return _json_or_text(raw)
    if types == {"string"}:
        return raw
    value = _as_json(raw)
    if value is not _NOT_JSON and _json_type_matches(value, types):
        whole = isinstance(value, float) and value.is_integer() and "number" not in types
        return int(value) if whole else value
    if "string" in types:
        return raw
    if raw.strip() in _PYTHON_LITERALS:
        kind, literal = _PYTHON_LITERALS[raw.strip()]
        if kind in types:
            return literal
    raise ParseError(f"{where}: parameter {key!r} of {name!r} is not {' or '.join(sorted(types))}")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a property schema allows (``type``, a list of types, ``anyOf``/``oneOf``)."""
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set()
    if isinstance(declared, list):
        types |= {kind for kind in declared if isinstance(kind, str)}
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types |= schema_types(choice)
    if schema.get("nullable"):
        types.add("null")
    return types


_NOT_JSON = object()


def _as_json(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _json_or_text(raw: str) -> Any:
    value = _as_json(raw)
    return raw if value is _NOT_JSON else value


def _json_type_matches(value: Any, types: set[str]) -> bool:
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    kinds = {str: "string", list: "array", dict: "object", type(None): "null"}
    return kinds[type(value)] in types


def _parameter_schemas(tools: list[ToolSpec]) -> dict[str, dict[str, Any] | None]:
    """Each tool's ``properties`` by tool name (None when it declares none)."""
    schemas: dict[str, dict[str, Any] | None] = {}
    for tool in tools:
        function: Any = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        schemas[function["name"]] = dict(properties) if isinstance(properties, Mapping) else None
    return schemas
