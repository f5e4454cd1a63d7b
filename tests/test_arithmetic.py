"""safe_eval, format_number, numbers_equal and CalculatorTool: semantics, hostile input, fuzzing.

The fuzz tests run about 12,000 generated inputs in all. Each input must give a number or a
``ValueError`` (nothing else) within ``CALL_LIMIT_S``; a call over the limit is timed twice
more and judged by its fastest run, so a scheduler hiccup on a shared machine is not a failure
while an input that is slow every time is.
"""

from __future__ import annotations

import asyncio
import json
import math
import string
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from post_training_cookbook.envs import Tool, ToolResult
from post_training_cookbook.envs import safe_eval as exported_safe_eval
from post_training_cookbook.envs.arithmetic import (
    CalculatorTool,
    format_number,
    numbers_equal,
    safe_eval,
)

CALL_LIMIT_S = 0.05
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def timed_outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """("value", result) or ("error", message) of ``call``; fails if it is slow or raises else."""
    fastest = math.inf
    for _ in range(3):
        start = time.perf_counter()
        try:
            outcome: tuple[str, Any] = ("value", call())
        except ValueError as exc:
            outcome = ("error", str(exc))
        fastest = min(fastest, time.perf_counter() - start)
        if fastest < CALL_LIMIT_S:
            return outcome
    raise AssertionError(f"call took {fastest * 1000:.1f} ms (limit {CALL_LIMIT_S * 1000:.0f})")


def evaluate_checked(expression: str) -> tuple[str, Any]:
    kind, value = timed_outcome(lambda: safe_eval(expression))
    if kind == "value":
        assert type(value) in (int, float), f"{expression!r} gave {type(value).__name__}"
        assert math.isfinite(value) and abs(value) <= 10**15
    else:
        assert value.startswith("calculator: ")
    return kind, value


# --- semantics -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("17 * (4 + 9)", 221),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("10 - 4 - 3", 3),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** 3 ** 2", 512),
        ("-2 ** 2", -4),
        ("(-2) ** 2", 4),
        ("--3", 3),
        ("+5", 5),
        ("abs(-4)", 4),
        ("min(3, 1, 2)", 1),
        ("max(3, 1, 2)", 3),
        ("min(7)", 7),
        ("sqrt(16)", 4),
        ("round(2.5)", 2),
        ("round(3.7)", 4),
        ("round(1234, -2)", 1200),
        ("1_000 + 1", 1001),
        ("  1 + 1  ", 2),
        ("(1 +\n 2)", 3),
        ("1000000000000000", 10**15),
    ],
)
def test_integer_arithmetic_gives_exact_ints(expression: str, expected: int) -> None:
    value = safe_eval(expression)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("7 / 2", 3.5),
        ("6 / 3", 2.0),
        ("2 ** -1", 0.5),
        ("1.5 * 4", 6.0),
        ("sqrt(2)", math.sqrt(2)),
        ("round(3.14159, 2)", 3.14),
        ("abs(-2.5)", 2.5),
        ("7.5 // 2", 3.0),
        ("2 ** 0.5", math.sqrt(2)),
        ("1e3 + 1", 1001.0),
        (".5 + .25", 0.75),
    ],
)
def test_division_and_decimals_give_floats(expression: str, expected: float) -> None:
    value = safe_eval(expression)
    assert value == pytest.approx(expected)
    assert type(value) is float


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("1.5 / 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("sqrt(-1)", "sqrt of a negative number"),
        ("2 ** 101", r"exponent too large \(max 100\)"),
        ("2 ** 60", "result too large"),
        ("1e16", "result too large"),
        ("10 ** 15 + 1", "result too large"),
        ("1e308 * 10", "result too large"),
        ("x + 1", r"unknown name 'x'; allowed functions: abs, round, min, max, sqrt"),
        ("pi", "unknown name 'pi'"),
        ("sqrt", r"sqrt is a function; call it like sqrt\(-3\)"),
        ("sqrt(1, 2)", "exactly one argument"),
        ("abs()", "exactly one argument"),
        ("min()", "at least one argument"),
        ("round(1, 2, 3)", "one or two arguments"),
        ("round(1.5, 0.5)", "digits must be an integer"),
        ("round(5, -10 ** 15)", "digits must be an integer"),
        ("1j", "complex numbers are not supported"),
        ("True", "only numbers are allowed"),
        ("None", "only numbers are allowed"),
        ("2 ^ 3", r"use \*\* for powers"),
        ("2 × 3", "use \\* to multiply"),
        ("1, 2", "unsupported syntax"),
        ("1 < 2", "unexpected character '<'"),
        ("1 if 1 else 2", "unsupported syntax"),
        ("not 1", "unsupported syntax"),
        ("1 and 2", "unsupported syntax"),
        ("1 +", "invalid syntax"),
        ("", "empty expression"),
        ("   ", "empty expression"),
    ],
)
def test_invalid_expressions_raise_value_errors_that_say_what_to_fix(
    expression: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        safe_eval(expression)


def test_non_string_expressions_raise_value_error() -> None:
    with pytest.raises(ValueError, match="must be a string, got int"):
        safe_eval(42)  # type: ignore[arg-type]


def test_safe_eval_is_exported_from_envs() -> None:
    assert exported_safe_eval is safe_eval


# --- hostile input -------------------------------------------------------------------------

HOSTILE_EXPRESSIONS = {
    "tower of powers": ("9**9**9**9", "exponent too large"),
    "huge power": ("10**10**10", "exponent too large"),
    "power of a huge base": ("(10**15)**100", "result too large"),
    "float power overflow": ("1e15 ** 100", "result too large"),
    "string repetition": ("'a'*10**9", "unexpected character"),
    "import": ("__import__('os')", "unexpected character"),
    "import without quotes": ("__import__(os)", "only these functions can be called"),
    "builtin call": ("eval(1)", "only these functions can be called"),
    "attribute access": ("(1).real", "attribute access is not allowed"),
    "dunder attribute": ("(1).__class__", "attribute access is not allowed"),
    "method call on a function": ("abs.__call__(1)", "only these functions can be called"),
    "lambda": ("(lambda: 1)()", "unexpected character ':'"),
    "list comprehension": ("[x for x in (1, 2)]", "unexpected character"),
    "generator expression": ("sum(x for x in (1, 2))", "only these functions"),
    "generator argument": ("max(x for x in (1, 2))", "unsupported syntax"),
    "starred argument": ("max(*(1, 2))", "positional arguments only"),
    "keyword argument": ("round(1, ndigits=2)", "unexpected character '='"),
    "walrus": ("(x := 1)", "unexpected character ':'"),
    "name": ("y", "unknown name 'y'"),
    "keyword": ("yield", "invalid syntax"),
    "await": ("await 1", "unsupported syntax (Await)"),
    "string literal": ("'1'", "unexpected character"),
    "bytes literal": ("b'1'", "unexpected character"),
    "null byte": ("1\x00", "unexpected character"),
    "deep parentheses": ("(" * 100_000 + "1" + ")" * 100_000, "expression too long"),
    "parentheses just past the limit": ("(" * 21 + "1" + ")" * 21, "nested too deeply"),
    "ten megabytes": ("1+" * 5_000_000 + "1", "expression too long"),
    "long integer literal": ("9" * 200, "result too large"),
    "unary chain": ("-" * 199 + "1", None),
    "long sum": ("+".join(["1"] * 100), None),
}


@pytest.mark.parametrize("name", list(HOSTILE_EXPRESSIONS))
def test_hostile_expressions_fail_fast_with_value_error(name: str) -> None:
    expression, message = HOSTILE_EXPRESSIONS[name]
    kind, value = evaluate_checked(expression)
    if message is None:  # deep but legitimate: evaluates, quickly
        assert kind == "value"
    else:
        assert kind == "error"
        assert message in value


def test_twenty_nested_parentheses_are_accepted() -> None:
    assert safe_eval("(" * 20 + "1" + ")" * 20) == 1


def test_error_message_tells_the_model_the_exponent_limit() -> None:
    with pytest.raises(ValueError) as info:
        safe_eval("2 ** 1000")
    assert str(info.value) == "calculator: exponent too large (max 100)"


# --- format_number and numbers_equal -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (42, "42"),
        (42.0, "42"),
        (-3, "-3"),
        (0.0, "0"),
        (-0.0, "0"),
        (2.5, "2.5"),
        (1 / 3, "0.333333"),
        (2 / 3, "0.666667"),
        (0.1 + 0.2, "0.3"),
        (-3.50, "-3.5"),
        (1e-7, "0"),
        (-1e-7, "0"),
        (2.9999999, "3"),
        (10**15, "1000000000000000"),
        (1e15, "1000000000000000"),
    ],
)
def test_format_number_prints_integral_values_as_integers_and_others_to_six_decimals(
    value: float, text: str
) -> None:
    assert format_number(value) == text


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_format_number_refuses_non_finite_values(value: float) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        format_number(value)


@pytest.mark.parametrize(
    ("reply", "target"),
    [
        ("42", "42"),
        ("42.0", "42"),
        (" 42 ", "42"),
        ("\n42\n", "42.00"),
        ("-3.50", "-3.5"),
        ("+7", "7"),
        ("42.", "42"),
        (".5", "0.5"),
        ("3.14159", "3.14"),
        ("3.144", "3.14"),
        ("0.125", "0.13"),
        ("-0.125", "-0.13"),
        ("-0", "0"),
        ("0.004", "0"),
    ],
)
def test_numbers_equal_after_rounding_both_to_two_decimals(reply: str, target: str) -> None:
    assert numbers_equal(reply, target)
    assert numbers_equal(target, reply)


@pytest.mark.parametrize(
    ("reply", "target"),
    [
        ("43", "42"),
        ("3.146", "3.14"),
        ("0.005", "0"),
        ("-42", "42"),
        ("42 apples", "42"),
        ("The answer is 42", "42"),
        ("4 2", "42"),
        ("1,000", "1000"),
        ("1e3", "1000"),
        ("", "0"),
        ("-", "0"),
        ("nan", "nan"),
        ("inf", "inf"),
        ("42", "forty-two"),
        ("1" * 100, "1" * 100),
        ("٤٢", "42"),  # Arabic-Indic digits: not a plain decimal number
        ("４２", "42"),  # fullwidth digits
        ("٤٢", "٤٢"),
    ],
)
def test_numbers_equal_rejects_other_numbers_and_text_around_a_number(
    reply: str, target: str
) -> None:
    assert not numbers_equal(reply, target)


# --- CalculatorTool ------------------------------------------------------------------------


def execute(arguments: str) -> ToolResult:
    return asyncio.run(CalculatorTool().execute(arguments))


def test_calculator_tool_satisfies_the_tool_protocol_with_a_required_string_expression() -> None:
    tool = CalculatorTool()
    assert isinstance(tool, Tool)
    assert tool.name == "calculator"
    assert tool.parameters_schema["type"] == "object"
    assert tool.parameters_schema["required"] == ["expression"]
    assert tool.parameters_schema["properties"]["expression"]["type"] == "string"


@pytest.mark.parametrize(
    ("expression", "content"),
    [("17 * (4 + 9)", "221"), ("6 / 3", "2"), ("1 / 3", "0.333333"), ("sqrt(2)", "1.414214")],
)
def test_calculator_tool_returns_the_formatted_value(expression: str, content: str) -> None:
    result = execute(json.dumps({"expression": expression}))
    assert result == ToolResult(content=content)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("17 * 13", "not valid JSON"),
        ('{"expression": ', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"2 + 2"', "must be a JSON object"),
        ("{}", 'missing "expression"'),
        ('{"expr": "1 + 1"}', 'missing "expression"'),
        ('{"expression": 5}', '"expression" must be a string, got int'),
        ('{"expression": null}', '"expression" must be a string, got NoneType'),
        ('{"expression": "1 / 0"}', "division by zero"),
        ("[" * 2000 + "]" * 2000, "not valid JSON"),
        (json.dumps({"expression": "1" * 10_000}), "arguments too long"),
    ],
)
def test_calculator_tool_rejects_bad_arguments_with_value_error(
    arguments: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        execute(arguments)


def test_calculator_tool_ignores_extra_argument_keys() -> None:
    assert execute('{"expression": "2 + 2", "note": "x"}').content == "4"


# --- fuzzing -------------------------------------------------------------------------------

NUMBER_LITERALS = st.one_of(
    st.integers(0, 10**6).map(str),
    st.integers(0, 10**40).map(str),
    st.floats(0, 1e20, allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["0", "1", "2", "9", "10", "0.5", ".5", "1e308", "1e999", "1_000", "0x1F"]),
)
BINARY_OPERATORS = st.sampled_from(["+", "-", "*", "/", "//", "%", "**"])
FUNCTIONS = st.sampled_from(["abs", "round", "min", "max", "sqrt"])


def _compound(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(children, BINARY_OPERATORS, children, st.sampled_from(["", " "])).map(
            lambda parts: f"{parts[0]}{parts[3]}{parts[1]}{parts[3]}{parts[2]}"
        ),
        st.tuples(st.sampled_from(["-", "+"]), children).map("".join),
        children.map(lambda child: f"({child})"),
        st.tuples(FUNCTIONS, st.lists(children, max_size=3)).map(
            lambda parts: f"{parts[0]}({', '.join(parts[1])})"
        ),
    )


EXPRESSIONS = st.recursive(NUMBER_LITERALS, _compound, max_leaves=12)

JUNK = st.sampled_from(
    [
        *"()[]{},.'\"_:;=<>!^&|~@#$\\ \t\n\x00",
        *["**", "//", "**-", "9" * 30, "1e308", "x", "__import__", "lambda", "for", "if", "not"],
        *["(" * 25, ")" * 25, "é", "٣", "１", "\u200b", "\ud800", "sqrt(", "round(", "abs"],
    ]
)
TOKENS = st.sampled_from(
    [
        *["(", ")", "**", "*", "/", "//", "%", "+", "-", " ", ",", ".", "0", "1", "9", "99999999"],
        *["1e15", "1e308", "0.5", "sqrt", "round", "abs", "min", "max", "x", "'a'", "j", "_"],
    ]
)


@st.composite
def near_valid_expressions(draw: st.DrawFn) -> str:
    """A valid-looking expression with junk inserted, a character deleted, or tokens mixed."""
    kind = draw(st.sampled_from(["insert", "delete", "soup"]))
    if kind == "soup":
        return "".join(draw(st.lists(TOKENS, max_size=40)))
    expression = draw(EXPRESSIONS)
    position = draw(st.integers(0, len(expression)))
    if kind == "insert":
        return expression[:position] + draw(JUNK) + expression[position:]
    return expression[:position] + expression[position + 1 :]


def _sqrt(x: Any) -> Any:
    root = math.isqrt(x) if isinstance(x, int) and x >= 0 else None
    return root if root is not None and root * root == x else math.sqrt(x)


def _python_value(expression: str) -> Any:
    # Trusted here: the expression came from our grammar and safe_eval already bounded it.
    # min and max take their arguments as a tuple, so min(7) is 7 as in safe_eval; sqrt of a
    # perfect square stays an int, as in safe_eval (so round(0, sqrt(0)) is round(0, 0)).
    functions = {
        "abs": abs,
        "round": round,
        "min": lambda *args: min(args),
        "max": lambda *args: max(args),
        "sqrt": _sqrt,
    }
    return eval(expression, {"__builtins__": {}}, functions)


def test_generated_expressions_match_python_or_fail_with_value_error_fast() -> None:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=3000)
    @given(EXPRESSIONS)
    def run(expression: str) -> None:
        kind, value = evaluate_checked(expression)
        outcomes[kind] += 1
        if kind == "value":
            assert math.isclose(value, _python_value(expression), rel_tol=1e-9, abs_tol=1e-9)

    run()
    assert outcomes.total() >= 2900
    assert outcomes["value"] >= 600  # the grammar reaches real evaluation, not only errors


@pytest.mark.parametrize(
    ("strategy", "examples"),
    [
        (st.text(max_size=300), 2500),
        (st.text(alphabet=string.printable, max_size=300), 2000),
        (near_valid_expressions(), 2500),
    ],
    ids=["unicode text", "printable text", "near-valid expressions"],
)
def test_random_input_gives_a_number_or_value_error_fast(
    strategy: st.SearchStrategy[str], examples: int
) -> None:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=examples)
    @given(strategy)
    def run(expression: str) -> None:
        outcomes[evaluate_checked(expression)[0]] += 1

    run()
    assert outcomes.total() >= examples * 0.95


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=10,
)
TOOL_ARGUMENTS = st.one_of(
    st.text(max_size=200),
    JSON_VALUES.map(json.dumps),
    st.dictionaries(st.just("expression"), JSON_VALUES, min_size=1).map(json.dumps),
    st.one_of(EXPRESSIONS, near_valid_expressions()).map(lambda e: json.dumps({"expression": e})),
    st.text(max_size=100).map(lambda text: '{"expression": ' + text + "}"),
)


def test_calculator_tool_gives_a_number_or_value_error_fast_for_random_arguments() -> None:
    outcomes: Counter[str] = Counter()
    loop = asyncio.new_event_loop()
    tool = CalculatorTool()

    @settings(FUZZ, max_examples=2000)
    @given(TOOL_ARGUMENTS)
    def run(arguments: str) -> None:
        kind, value = timed_outcome(lambda: loop.run_until_complete(tool.execute(arguments)))
        outcomes[kind] += 1
        if kind == "value":
            assert isinstance(value, ToolResult)
            assert format_number(float(value.content)) == value.content
        else:
            assert value.startswith("calculator: ")

    try:
        run()
    finally:
        loop.close()
    assert outcomes.total() >= 1900
    assert outcomes["value"] >= 100
