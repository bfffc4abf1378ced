"""The seeded synthetic calculator task ``calc``."""

from __future__ import annotations

import ast
import random
import re

import pytest

from data.schema import validate_record
from data.synthetic import CALC_SYSTEM_PROMPT, TASKS, make_calc_records, make_task

OPERATOR = re.compile(r"[+\-*]")


def _evaluate(expression: str) -> int:
    """An independent, safe evaluator: integer literals with + - * only, Python's precedence."""
    operations = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in operations:
            return operations[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"not allowed in a calc expression: {ast.dump(node)}")

    return value(ast.parse(expression, mode="eval").body)


def test_same_seed_gives_the_same_records() -> None:
    assert make_calc_records(50, seed=7) == make_calc_records(50, seed=7)


def test_different_seeds_give_different_problems() -> None:
    first = {r.extra["expression"] for r in make_calc_records(50, seed=0)}
    second = {r.extra["expression"] for r in make_calc_records(50, seed=1)}
    assert first != second
    assert len(first & second) < 5


def test_num_only_cuts_the_sequence() -> None:
    assert make_calc_records(200, seed=3)[:20] == make_calc_records(20, seed=3)


def test_global_random_state_is_left_alone() -> None:
    random.seed(123)
    state = random.getstate()
    make_calc_records(20, seed=0)
    assert random.getstate() == state


def test_ground_truth_is_the_exact_value_of_the_expression() -> None:
    for record in make_calc_records(300, seed=11, max_ops=3):
        assert record.ground_truth == str(_evaluate(record.extra["expression"]))


def test_answers_are_non_negative_integers() -> None:
    assert all(record.ground_truth.isdigit() for record in make_calc_records(300, seed=5))


def test_multiplication_binds_tighter_than_addition_and_subtraction() -> None:
    records = make_calc_records(300, seed=2)
    mixed = [r for r in records if "*" in r.extra["expression"] and re.search("[+-]", r.extra["expression"])]
    assert mixed, "expected some problems mixing * with + or -"
    for record in mixed:
        assert record.ground_truth == str(_evaluate(record.extra["expression"]))


@pytest.mark.parametrize(("min_digits", "max_digits"), [(3, 4), (1, 2), (5, 5)])
def test_operands_have_min_to_max_digits(min_digits: int, max_digits: int) -> None:
    records = make_calc_records(200, seed=0, min_digits=min_digits, max_digits=max_digits)
    lengths = {len(operand) for r in records for operand in OPERATOR.split(r.extra["expression"])}
    assert lengths == set(range(min_digits, max_digits + 1))


@pytest.mark.parametrize("max_ops", [1, 2, 4])
def test_operator_count_is_between_one_and_max_ops(max_ops: int) -> None:
    counts = {len(OPERATOR.findall(r.extra["expression"])) for r in make_calc_records(200, seed=0, max_ops=max_ops)}
    assert counts == set(range(1, max_ops + 1))


def test_only_plus_minus_and_times_appear() -> None:
    expressions = [r.extra["expression"] for r in make_calc_records(200, seed=0)]
    assert all(re.fullmatch(r"\d+([+\-*]\d+)+", e) for e in expressions)
    assert {op for e in expressions for op in OPERATOR.findall(e)} == {"+", "-", "*"}


def test_question_shows_the_expression_with_spaces() -> None:
    for record in make_calc_records(50, seed=0):
        spaced = " ".join(re.findall(r"\d+|[+\-*]", record.extra["expression"]))
        assert spaced in record.prompt[1]["content"]


def test_questions_use_several_templates() -> None:
    openings = {r.prompt[1]["content"].split()[0] for r in make_calc_records(100, seed=0)}
    assert len(openings) >= 3


def test_record_layout() -> None:
    record = make_calc_records(1, seed=0)[0]
    assert [m["role"] for m in record.prompt] == ["system", "user"]
    assert record.prompt[0]["content"] == CALC_SYSTEM_PROMPT
    assert record.data_source == "calc"
    assert record.tools_kwargs == {"answer_check": {"create_kwargs": {"ground_truth": record.ground_truth}}}
    assert set(record.extra) == {"expression"}


def test_records_are_indexed_by_position() -> None:
    assert [r.index for r in make_calc_records(5, seed=0)] == [0, 1, 2, 3, 4]


def test_records_pass_validation_unchanged() -> None:
    for record in make_calc_records(20, seed=0):
        assert validate_record(record.to_dict(), index=record.index) == record


def test_system_prompt_is_short_and_asks_for_the_calculator_and_a_boxed_answer() -> None:
    assert len(CALC_SYSTEM_PROMPT) <= 200
    assert "calculator" in CALC_SYSTEM_PROMPT
    assert "\\boxed{N}" in CALC_SYSTEM_PROMPT


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="min_digits"):
        make_calc_records(1, min_digits=4, max_digits=3)
    with pytest.raises(ValueError, match="max_ops"):
        make_calc_records(1, max_ops=0)


def test_tasks_look_up_calc_by_name() -> None:
    assert TASKS["calc"](10, 4) == make_calc_records(10, seed=4)
    assert make_task("calc", 10, 4) == make_calc_records(10, seed=4)


def test_unknown_task_lists_the_known_tasks() -> None:
    with pytest.raises(ValueError, match=r"unknown synthetic task 'gsm9k'; known tasks: calc"):
        make_task("gsm9k", 10, 0)
