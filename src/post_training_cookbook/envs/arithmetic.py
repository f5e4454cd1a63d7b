"""A safe arithmetic evaluator and the ``calculator`` tool built on it. Never ``eval``.

``safe_eval`` accepts numbers, ``+ - * / // % **``, unary ``+``/``-``, parentheses and the
functions ``abs, round, min, max, sqrt`` called by bare name. It parses with :mod:`ast` and
walks the tree itself, evaluating only those node types. Semantics are Python's (``round``
rounds halves to even, ``//`` floors), except that ``sqrt`` of a perfect square stays an ``int``.

Model output is hostile input, so every cost is bounded before it is paid: the text's length,
its characters and its parenthesis depth are checked by linear scans before ``ast.parse``;
during evaluation every exponent and every intermediate value is bounded, so a power is
refused before it is computed. Every failure is a ``ValueError`` starting with
``calculator:`` whose message tells a model what to change.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import string
import warnings
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal, localcontext
from typing import Any

from post_training_cookbook.envs.base import ToolResult

Number = int | float

MAX_EXPRESSION_LENGTH = 200
"""Longest expression accepted, in characters."""

MAX_PAREN_DEPTH = 20
"""Deepest parenthesis nesting accepted."""

MAX_EXPONENT = 100
"""Largest absolute exponent of ``**``."""

MAX_MAGNITUDE = 10**15
"""Largest absolute value of any number: literal, intermediate or result."""

MAX_ROUND_DIGITS = 15
"""Largest absolute ``ndigits`` of ``round(x, ndigits)``."""

MAX_ARGUMENTS_LENGTH = 4096
"""Longest JSON arguments string ``CalculatorTool`` accepts, in characters."""

FUNCTION_NAMES = ("abs", "round", "min", "max", "sqrt")

_ALLOWED_CHARACTERS = frozenset(string.ascii_letters + string.digits + " \t\n+-*/%().,_")
_SYNTAX_HINT = "use numbers, + - * / // % **, parentheses and " + ", ".join(FUNCTION_NAMES)

_BINARY_OPERATORS: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _refused(reason: str) -> ValueError:
    # A plain ValueError: envs report ``repr(exc)`` to the model, so the type name stays short.
    return ValueError(f"calculator: {reason}")


def safe_eval(expression: str) -> Number:
    """The value of an arithmetic expression such as ``"17 * (4 + 9)"``; ``ValueError`` if none.

    Integer arithmetic stays ``int`` (``7 // 2`` is ``3``); ``/`` and ``sqrt`` of a non-square
    give ``float``.
    """
    _check_text(expression)
    tree = _parse(expression.strip())
    try:
        return _evaluate(tree.body)
    except ZeroDivisionError:
        raise _refused("division by zero") from None
    except OverflowError:
        raise _refused(f"result too large (max absolute value {MAX_MAGNITUDE:.0e})") from None
    except RecursionError:  # unreachable within the length bound; kept as a backstop
        raise _refused("expression nested too deeply") from None


def _check_text(expression: object) -> None:
    # Linear scans only: nothing here can be slow on a 10 MB string or 100k parentheses.
    if not isinstance(expression, str):
        raise _refused(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise _refused(
            f"expression too long ({len(expression)} characters; max {MAX_EXPRESSION_LENGTH})"
        )
    if not expression.strip():
        raise _refused("empty expression")
    for char in expression:
        if char not in _ALLOWED_CHARACTERS:
            raise _refused(f"unexpected character {char!r}; {_character_hint(char)}")
    depth = 0
    for char in expression:
        depth += (char == "(") - (char == ")")
        if depth > MAX_PAREN_DEPTH:
            raise _refused(f"parentheses nested too deeply (max {MAX_PAREN_DEPTH})")


def _character_hint(char: str) -> str:
    hints = {"^": "use ** for powers", "×": "use * to multiply", "÷": "use / to divide"}
    return hints.get(char, _SYNTAX_HINT)


def _parse(text: str) -> ast.Expression:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning on "1if 1else 2"
            return ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _refused(f"invalid syntax ({exc.msg}); {_SYNTAX_HINT}") from None
    except (ValueError, RecursionError, MemoryError):
        raise _refused(f"invalid syntax; {_SYNTAX_HINT}") from None


def _evaluate(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        return _bounded(_literal(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _bounded(_binary(node.op, _evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.Call):
        return _bounded(_call(node))
    if isinstance(node, ast.Name):
        if node.id in FUNCTION_NAMES:
            raise _refused(f"{node.id} is a function; call it like {node.id}(-3)")
        raise _refused(f"unknown name {node.id!r}; allowed functions: {', '.join(FUNCTION_NAMES)}")
    if isinstance(node, ast.Attribute):
        raise _refused("attribute access is not allowed")
    raise _refused(f"unsupported syntax ({type(node).__name__}); {_SYNTAX_HINT}")


def _literal(value: object) -> Number:
    # bool is an int subclass; True is not a number a calculator should accept.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if isinstance(value, complex):
        raise _refused("complex numbers are not supported")
    raise _refused(f"only numbers are allowed, got {value!r}")


def _binary(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Pow):
        return _power(left, right)
    function = _BINARY_OPERATORS.get(type(op))
    if function is None:
        raise _refused(f"unsupported operator ({type(op).__name__}); {_SYNTAX_HINT}")
    return function(left, right)


def _power(base: Number, exponent: Number) -> Number:
    # Checked before the work: base and exponent are bounded, so the result has at most
    # ~5,000 bits and costs microseconds; _bounded then refuses it if it is too large.
    if abs(exponent) > MAX_EXPONENT:
        raise _refused(f"exponent too large (max {MAX_EXPONENT})")
    result = base**exponent
    if isinstance(result, complex):  # (-8) ** 0.5
        raise _refused("result is not a real number (negative base, fractional exponent)")
    return result


def _call(node: ast.Call) -> Number:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name not in FUNCTION_NAMES:
        raise _refused(f"only these functions can be called: {', '.join(FUNCTION_NAMES)}")
    if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
        raise _refused(f"{name}() takes plain positional arguments only")
    arguments = [_evaluate(arg) for arg in node.args]
    if name in ("min", "max"):
        if not arguments:
            raise _refused(f"{name}() needs at least one argument")
        return min(arguments) if name == "min" else max(arguments)
    if name == "round":
        return _round(arguments)
    if len(arguments) != 1:
        raise _refused(f"{name}() takes exactly one argument")
    return abs(arguments[0]) if name == "abs" else _sqrt(arguments[0])


def _round(arguments: list[Number]) -> Number:
    if len(arguments) == 1:
        return round(arguments[0])
    if len(arguments) != 2:
        raise _refused("round() takes one or two arguments: round(x) or round(x, digits)")
    value, digits = arguments
    # round(5, -10**15) would build 10**(10**15): bound digits before Python does the work.
    if not isinstance(digits, int) or abs(digits) > MAX_ROUND_DIGITS:
        raise _refused(f"round() digits must be an integer from -{MAX_ROUND_DIGITS} to 15")
    return round(value, digits)


def _sqrt(value: Number) -> Number:
    if value < 0:
        raise _refused("sqrt of a negative number")
    if isinstance(value, int):
        root = math.isqrt(value)
        if root * root == value:
            return root  # perfect squares stay integers
    return math.sqrt(value)


def _bounded(value: Number) -> Number:
    # NaN compares False with everything, so finiteness is checked on its own.
    if isinstance(value, float) and not math.isfinite(value):
        raise _refused(f"result too large (max absolute value {MAX_MAGNITUDE:.0e})")
    if abs(value) > MAX_MAGNITUDE:
        raise _refused(f"result too large (max absolute value {MAX_MAGNITUDE:.0e})")
    return value


def format_number(value: Number) -> str:
    """Canonical text of a number: integral values as integers ("42" for 42.0), others
    rounded to 6 decimal places with trailing zeros stripped ("0.333333", "2.5")."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot format a non-finite number: {value!r}")
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


_DECIMAL_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")  # ASCII digits only
_MAX_NUMBER_TEXT = 64  # longer replies are not numbers a grader should parse
_CENTS = Decimal("0.01")


def numbers_equal(reply: str, target: str) -> bool:
    """Whether two texts are the same number, for grading a final answer.

    Each side, stripped of surrounding whitespace, must be a plain decimal number
    ("42", "-3.50", "+7", ".5"; no other text, no exponent, no thousands separators). The
    two are equal when they agree after rounding each to 2 decimal places, halves away
    from zero: "3.14159" equals "3.14", "0.125" equals "0.13", "42.0" equals "42".
    """
    left, right = _parse_decimal(reply), _parse_decimal(target)
    if left is None or right is None:
        return False
    with localcontext() as context:
        context.prec = _MAX_NUMBER_TEXT + 4  # room to quantize any accepted text exactly
        return left.quantize(_CENTS, ROUND_HALF_UP) == right.quantize(_CENTS, ROUND_HALF_UP)


def _parse_decimal(text: str) -> Decimal | None:
    text = text.strip()
    if len(text) > _MAX_NUMBER_TEXT or not _DECIMAL_NUMBER.fullmatch(text):
        return None
    return Decimal(text)


class CalculatorTool:
    """The ``calculator`` tool: JSON ``{"expression": ...}`` in, the formatted value out."""

    name: str = "calculator"
    description: str = (
        "Evaluate an arithmetic expression. Supports numbers, + - * / // % ** (power), "
        "parentheses, and the functions abs, round, min, max, sqrt. Example: 17 * (4 + 9)."
    )
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "The expression to evaluate, e.g. (12 + 30) / 7.",
            }
        },
        "required": ["expression"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        """Evaluate the expression in ``arguments``; ``ValueError`` with a fix for bad input."""
        return ToolResult(content=format_number(safe_eval(_expression(arguments))))


_ARGUMENTS_HINT = 'arguments must be a JSON object like {"expression": "2 + 2"}'


def _expression(arguments: str) -> str:
    if not isinstance(arguments, str):
        raise _refused(f"{_ARGUMENTS_HINT}, got {type(arguments).__name__}")
    if len(arguments) > MAX_ARGUMENTS_LENGTH:
        raise _refused(f"arguments too long (max {MAX_ARGUMENTS_LENGTH} characters)")
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise _refused(f"arguments are not valid JSON; {_ARGUMENTS_HINT}") from None
    if not isinstance(parsed, dict):
        raise _refused(_ARGUMENTS_HINT)
    if "expression" not in parsed:
        raise _refused(f'missing "expression"; {_ARGUMENTS_HINT}')
    expression = parsed["expression"]
    if not isinstance(expression, str):
        raise _refused(f'"expression" must be a string, got {type(expression).__name__}')
    return expression
