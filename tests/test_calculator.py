"""The exact calculator: ``evaluate``, ``format_number`` and ``CalculatorTool``."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2", "3"),
        ("123456789**5", str(123456789**5)),
        ("123456789 ^ 5", str(123456789**5)),
        ("2**100", str(2**100)),
        ("99999999999999999999 * 99999999999999999999", str(99999999999999999999**2)),
        ("0.1 + 0.2", "0.3"),
        ("1/3", "1/3"),
        ("1/3 + 1/6", "0.5"),
        ("2/3 * 3", "2"),
        ("7/2", "3.5"),
        ("-1/8", "-0.125"),
        ("22/7", "22/7"),
        ("12.0", "12"),
        (".5 + 1.", "1.5"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 * 3 ** 2", "18"),
        ("2 ** 3 ** 2", "512"),
        ("-2 ** 2", "-4"),
        ("(-2) ** 2", "4"),
        ("-(-3)", "3"),
        ("+5 - -5", "10"),
        ("2 ** -2", "0.25"),
        ("(2/3) ** -2", "2.25"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("-7 % 3", "2"),
        ("7.5 % 2", "1.5"),
        ("1 ** (10 ** 400)", "1"),
        ("(-1) ** (10 ** 400 + 1)", "-1"),
        ("  ( 1+2 )*( 3+4 )  ", "21"),
    ],
)
def test_evaluate_computes_exactly(expression: str, expected: str) -> None:
    assert format_number(evaluate(expression)) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % (2 - 2)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("__import__('os')", "function calls are not allowed"),
        ("abs(-3)", "function calls are not allowed"),
        ("x + 1", "the name 'x' is unknown"),
        ("pi", "the name 'pi' is unknown"),
        ("(1).real", "attribute access is not allowed"),
        ("'1' + '2'", "is not a number"),
        ("1 < 2", "comparisons are not allowed"),
        ("(5)[0]", "indexing is not allowed"),
        ("1,234 + 1", "thousands separators"),
        ("1_000", "is not a number"),
        ("1e3", "is not a number"),
        ("0x10", "is not a number"),
        ("2j", "is not a number"),
        ("True + 1", "is not a number"),
        ("1 & 2", "the operator '&' is not supported"),
        ("~1", "the operator '~' is not supported"),
        ("2 ** 0.5", "the exponent must be an integer"),
        ("2**10**10", "digits, over the limit"),
        ("(3/7) ** 100000", "digits, over the limit"),
        ("10 ** 1999 * 10 ** 1999", "more than 2000 digits"),
        ("(1 + 2", "cannot parse"),
        ("", "empty"),
    ],
)
def test_evaluate_refuses_bad_expressions_with_a_clear_message(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expression)


def test_evaluate_refuses_an_expression_over_the_length_limit() -> None:
    with pytest.raises(CalculatorError, match="over the limit of 500"):
        evaluate("1+" * 250 + "1")


def test_evaluate_reads_decimals_exactly() -> None:
    assert evaluate("0.1") == Fraction(1, 10)


def test_evaluate_holds_results_to_max_digits() -> None:
    assert evaluate("10 ** 9", max_digits=10) == 10**9
    with pytest.raises(CalculatorError):
        evaluate("10 ** 20", max_digits=10)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (Fraction(123), "123"),
        (Fraction(-7), "-7"),
        (Fraction(0), "0"),
        (Fraction(7, 2), "3.5"),
        (Fraction(-1, 8), "-0.125"),
        (Fraction(3, 20), "0.15"),
        (Fraction(1, 1024), "0.0009765625"),
        (Fraction(1, 3), "1/3"),
        (Fraction(-5, 6), "-5/6"),
    ],
)
def test_format_number_writes_integers_terminating_decimals_and_fractions(value: Fraction, expected: str) -> None:
    assert format_number(value) == expected


async def test_tool_returns_the_result_as_text() -> None:
    tool = CalculatorTool()
    instance_id = await tool.create()
    try:
        response = await tool.execute(instance_id, {"expression": "(123456789 * 987654321) / 7"})
    finally:
        await tool.release(instance_id)
    assert response.text == format_number(Fraction(123456789 * 987654321, 7))
    assert response.reward == 0.0
    assert response.metrics == {}


@pytest.mark.parametrize("parameters", [{"expression": "1/0"}, {"expression": 12}, {}])
async def test_tool_answers_bad_input_with_an_error_message(parameters: dict[str, object]) -> None:
    tool = CalculatorTool()
    instance_id = await tool.create()
    try:
        response = await tool.execute(instance_id, parameters)
    finally:
        await tool.release(instance_id)
    assert response.text.startswith("Error: ")
    assert response.metrics == {"error": True}


async def test_tool_applies_its_configured_limits() -> None:
    tool = CalculatorTool(config={"max_digits": 5, "max_expression_chars": 10})
    instance_id = await tool.create()
    try:
        within = await tool.execute(instance_id, {"expression": "10 ** 4"})
        too_many_digits = await tool.execute(instance_id, {"expression": "10 ** 6"})
        too_long = await tool.execute(instance_id, {"expression": "1 + 2 + 3 + 4"})
    finally:
        await tool.release(instance_id)
    assert within.text == "10000"
    assert "over the limit of 5" in too_many_digits.text
    assert "over the limit of 10" in too_long.text


@pytest.mark.parametrize("config", [{"max_digits": 0}, {"max_digits": "2000"}, {"max_expression_chars": -1}])
def test_tool_rejects_bad_config_values(config: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="calculator config"):
        CalculatorTool(config=config)


def test_tool_schema_names_the_calculator_and_requires_an_expression() -> None:
    schema = CalculatorTool().schema["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
