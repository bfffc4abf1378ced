"""An exact calculator tool: big integers, fractions and decimals, never floating point.

The expression is parsed with ``ast.parse(text, mode="eval")`` and the tree is walked with
``fractions.Fraction``; nothing is ever passed to ``eval``. Accepted: integer and decimal
literals (``0.1`` is exactly 1/10), parentheses, unary ``+``/``-`` and the binary operators
``+ - * / // % **`` with Python's meaning (``//`` floors, ``%`` takes the divisor's sign).
``^`` is read as a power (it is replaced by ``**`` before parsing), since models write ``2^10``.

Resource bombs are refused before they are computed: the expression length is bounded, a power
needs an integer exponent and its result size is estimated from the operands' bit lengths, and
every result is held to ``max_digits`` digits in its numerator and denominator.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction
from typing import Any

from tools.base import BaseTool, ToolResponse, function_schema

DEFAULT_MAX_DIGITS = 2000
DEFAULT_MAX_EXPRESSION_CHARS = 500
MAX_DECIMAL_DIGITS = 4000
"""A terminating fraction whose decimal form would need more digits than this is written ``p/q``."""

_LITERAL_RE = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_OPERATORS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}
_UNSUPPORTED_OPERATORS = {
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}
_UNSUPPORTED_NODES = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "indexing is not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "'and'/'or' are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.IfExp: "conditional expressions are not allowed",
    ast.Tuple: "tuples are not allowed",
    ast.List: "lists are not allowed",
}
_LOG10_2 = math.log10(2)


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says what and why."""


def _digits(value: Fraction) -> int:
    """About how many decimal digits the larger of numerator and denominator has."""
    bits = max(abs(value.numerator).bit_length(), value.denominator.bit_length())
    return math.ceil(bits * _LOG10_2)


def _short(value: Fraction) -> str:
    """``value`` formatted, or its size when that would be long (for error messages)."""
    if _digits(value) > 30:
        return f"a number of about {_digits(value)} digits"
    return format_number(value)


def _power(base: Fraction, exponent: Fraction, max_digits: int) -> Fraction:
    """``base ** exponent`` for an integer exponent, refused when the result would be too large."""
    if exponent.denominator != 1:
        raise CalculatorError(f"the exponent must be an integer (no roots), got {_short(exponent)}")
    n = exponent.numerator
    if base == 0:
        if n < 0:
            raise CalculatorError("division by zero: 0 raised to a negative power")
        return Fraction(1 if n == 0 else 0)
    if abs(base) == 1:
        return Fraction(1 if base > 0 or n % 2 == 0 else -1)
    exponent_size = float(abs(n)) if n.bit_length() < 1000 else math.inf
    size = exponent_size * max(math.log10(abs(base.numerator)), math.log10(base.denominator))
    if size > max_digits:
        raise CalculatorError(
            f"the result of {_short(base)} ** {_short(exponent)} would have about {size:.3g} digits, "
            f"over the limit of {max_digits}"
        )
    return base**n


def _literal(node: ast.Constant, source: str, max_digits: int) -> Fraction:
    """A numeric literal, read exactly from its source text (``0.1`` -> 1/10)."""
    text = ast.get_source_segment(source, node) or ""
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)) or not _LITERAL_RE.fullmatch(text):
        raise CalculatorError(
            f"{text or repr(node.value)} is not a number the calculator reads: "
            "use plain integers or decimals such as 12 or 3.75"
        )
    value = Fraction(text)
    if _digits(value) > max_digits:
        raise CalculatorError(f"the number {text[:20]}... has more than {max_digits} digits")
    return value


def _refuse(node: ast.AST, source: str) -> CalculatorError:
    """The error for a node the calculator does not evaluate, naming it and quoting its text."""
    op = getattr(node, "op", None)
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r} is unknown: there are no variables or functions"
    elif op is not None and type(op) in _UNSUPPORTED_OPERATORS:
        what = f"the operator {_UNSUPPORTED_OPERATORS[type(op)]!r} is not supported"
    else:
        what = _UNSUPPORTED_NODES.get(type(node), f"{type(node).__name__} expressions are not allowed")
    return CalculatorError(
        f"{what} (in {ast.get_source_segment(source, node)!r}); "
        "use numbers, parentheses and + - * / // % ** (or ^) only"
    )


def _walk(node: ast.AST, source: str, max_digits: int) -> Fraction:
    """The exact value of one node of the expression tree."""
    if isinstance(node, ast.Constant):
        return _literal(node, source, max_digits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _walk(node.operand, source, max_digits)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _walk(node.left, source, max_digits)
        right = _walk(node.right, source, max_digits)
        if isinstance(node.op, ast.Pow):
            result = _power(left, right, max_digits)
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError(f"division by zero in {ast.get_source_segment(source, node)!r}")
        elif isinstance(node.op, ast.Add):
            result = left + right
        elif isinstance(node.op, ast.Sub):
            result = left - right
        elif isinstance(node.op, ast.Mult):
            result = left * right
        elif isinstance(node.op, ast.Div):
            result = left / right
        elif isinstance(node.op, ast.FloorDiv):
            result = Fraction(left // right)
        else:
            result = left % right
        if _digits(result) > max_digits:
            raise CalculatorError(f"the result has more than {max_digits} digits")
        return result
    raise _refuse(node, source)


def evaluate(
    expression: str, max_digits: int = DEFAULT_MAX_DIGITS, max_chars: int = DEFAULT_MAX_EXPRESSION_CHARS
) -> Fraction:
    """The exact value of an arithmetic expression; ``CalculatorError`` says what is wrong with a bad one.

    Results (and intermediate results) with more than ``max_digits`` digits in numerator or
    denominator are refused, powers before they are computed; so are expressions longer than
    ``max_chars`` characters.
    """
    if len(expression) > max_chars:
        raise CalculatorError(
            f"the expression has {len(expression)} characters, over the limit of {max_chars}; "
            "split the computation into steps"
        )
    if "," in expression:
        raise CalculatorError(
            "commas are not accepted: write numbers without thousands separators (1234567, not 1,234,567)"
        )
    source = expression.replace("^", "**").strip()
    if not source:
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError):
        raise CalculatorError(f"cannot parse {expression!r}") from None
    try:
        return _walk(tree.body, source, max_digits)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Fraction) -> str:
    """``123`` for an integer, an exact decimal (``3.5``, ``-0.125``) when it terminates, else ``p/q``."""
    numerator, denominator = value.numerator, value.denominator
    if denominator == 1:
        return str(numerator)
    twos = (denominator & -denominator).bit_length() - 1
    rest, fives = denominator >> twos, 0
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    places = max(twos, fives)
    if rest != 1 or places + abs(numerator).bit_length() * _LOG10_2 > MAX_DECIMAL_DIGITS:
        return f"{numerator}/{denominator}"
    digits = str(abs(numerator) * (10**places // denominator)).rjust(places + 1, "0")
    sign = "-" if numerator < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def _positive_int(config: dict[str, Any], key: str, default: int) -> int:
    """``config[key]`` as a positive integer; a ValueError naming the key otherwise."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"calculator config {key!r} must be a positive integer, got {value!r}")
    return value


class CalculatorTool(BaseTool):
    """``calculator(expression)``: exact arithmetic; a bad expression comes back as an ``Error: ...`` text.

    Config keys: ``max_digits`` (default 2000; at most 4000, below Python's 4300-digit limit on
    printing integers) and ``max_expression_chars`` (default 500).
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        self.max_digits = _positive_int(self.config, "max_digits", DEFAULT_MAX_DIGITS)
        """Most digits in a result's numerator or denominator; larger results are refused."""
        self.max_expression_chars = _positive_int(self.config, "max_expression_chars", DEFAULT_MAX_EXPRESSION_CHARS)
        """Longest expression accepted, in characters."""
        if self.max_digits > MAX_DECIMAL_DIGITS:
            raise ValueError(f"calculator config 'max_digits' must be at most {MAX_DECIMAL_DIGITS}")

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return function_schema(
            "calculator",
            "Exact arithmetic: + - * / // % ** and parentheses.",
            {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """Evaluate ``parameters["expression"]``; cheap enough (bounded sizes) to run on the event loop."""
        expression = parameters.get("expression")
        try:
            if not isinstance(expression, str):
                raise CalculatorError("calculator needs 'expression', a string such as '12*(3+4)'")
            result = format_number(evaluate(expression, self.max_digits, self.max_expression_chars))
        except CalculatorError as exc:
            return ToolResponse(text=f"Error: {exc}", metrics={"error": True})
        return ToolResponse(text=result)
