"""Seeded synthetic tasks. ``calc``: multi-digit arithmetic that calls for the calculator tool;
``calc-retry``: the same problems with ``interaction_kwargs`` for the answer checker, which tells
the model when its answer is wrong and lets it try again (``rollout/users/interactions.py``).

A problem looks like ``What is 4821 * 377 + 1290?``: 1 to ``max_ops`` operators from ``+ - *``
between operands of ``min_digits`` to ``max_digits`` digits, with the usual precedence, so the
answer is an exact (non-negative) integer. Records are drawn one after another from
``random.Random(seed)``, so a seed fixes the sequence and ``num`` only says where to cut it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from data.schema import Record

CALC_SYSTEM_PROMPT = "Use the calculator tool for arithmetic. Give the final answer as \\boxed{N}."
"""Kept short: the tiny character-level model reads it in every prompt."""

CALC_QUESTION_TEMPLATES = (
    "What is {expression}?",
    "Compute {expression}.",
    "Calculate {expression}.",
    "Evaluate {expression}.",
    "Find the value of {expression}.",
)
CALC_OPERATORS = ("+", "-", "*")


def make_calc_records(
    num: int, seed: int = 0, *, min_digits: int = 3, max_digits: int = 4, max_ops: int = 2
) -> list[Record]:
    """``num`` calculator problems; the same seed gives the same records, a larger ``num`` extends them."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits} and {max_digits}")
    if max_ops < 1:
        raise ValueError(f"max_ops must be >= 1, got {max_ops}")
    rng = random.Random(seed)
    records = []
    for index in range(num):
        operands, operators, answer = _draw_problem(rng, min_digits, max_digits, max_ops)
        expression = "".join(_interleave(operands, operators))
        shown = " ".join(_interleave(operands, operators))
        question = rng.choice(CALC_QUESTION_TEMPLATES).format(expression=shown)
        ground_truth = str(answer)
        records.append(
            Record(
                prompt=[
                    {"role": "system", "content": CALC_SYSTEM_PROMPT},
                    {"role": "user", "content": question},
                ],
                data_source="calc",
                ground_truth=ground_truth,
                tools_kwargs={"answer_check": {"create_kwargs": {"ground_truth": ground_truth}}},
                extra={"expression": expression},
                index=index,
            )
        )
    return records


def _draw_problem(
    rng: random.Random, min_digits: int, max_digits: int, max_ops: int
) -> tuple[list[int], list[str], int]:
    """Operands, operators and the exact answer; redrawn until the answer is not negative."""
    while True:
        num_ops = rng.randint(1, max_ops)
        operands = [_draw_operand(rng, min_digits, max_digits) for _ in range(num_ops + 1)]
        operators = [rng.choice(CALC_OPERATORS) for _ in range(num_ops)]
        answer = _evaluate(operands, operators)
        if answer >= 0:
            return operands, operators, answer


def _draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _evaluate(operands: list[int], operators: list[str]) -> int:
    """``a op b op c ...`` with ``*`` before ``+``/``-``, left to right, in exact integers."""
    terms = [operands[0]]  # signed products, summed at the end
    for operator, operand in zip(operators, operands[1:], strict=True):
        if operator == "*":
            terms[-1] *= operand
        else:
            terms.append(operand if operator == "+" else -operand)
    return sum(terms)


def _interleave(operands: list[int], operators: list[str]) -> list[str]:
    parts = [str(operands[0])]
    for operator, operand in zip(operators, operands[1:], strict=True):
        parts += [operator, str(operand)]
    return parts


def spaced_expression(expression: str) -> str:
    """``616+388*873`` -> ``616 + 388 * 873``: the form the question shows."""
    return " ".join(re.findall(r"\d+|[+\-*]", expression))


def calc_trace(record: Record) -> list[dict[str, Any]]:
    """The full conversation a good agent has for a calc record (what SFT imitates).

    The record's prompt, one calculator call whose expression is copied verbatim from the
    question, the calculator's exact result as the tool message, and ``\\boxed{result}``.
    """
    from tools.calculator import evaluate, format_number  # tools imports data; keep data importable alone

    if "expression" not in record.extra:
        raise ValueError(f"record {record.index}: not a calc record (no extra.expression)")
    expression = spaced_expression(record.extra["expression"])
    question = record.prompt[-1]["content"]
    if expression not in question:
        raise ValueError(f"record {record.index}: the question {question!r} does not show {expression!r}")
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    result = format_number(evaluate(expression))
    return [
        *(dict(message) for message in record.prompt),
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"\\boxed{{{result}}}"},
    ]


def direct_answer_trace(record: Record) -> list[dict[str, Any]]:
    """The conversation of an agent that answers at once without its tool: ``\\boxed{answer}``.

    The answer is the true one, but a small model cannot learn multi-digit arithmetic from it,
    so what such a model learns is the habit of answering from memory, and its guesses are wrong.
    """
    return [
        *(dict(message) for message in record.prompt),
        {"role": "assistant", "content": f"\\boxed{{{record.ground_truth}}}"},
    ]


def make_calc_sft_records(
    num: int,
    seed: int = 0,
    *,
    tool_call_share: float = 1.0,
    min_digits: int = 3,
    max_digits: int = 4,
    max_ops: int = 2,
) -> list[Record]:
    """``make_calc_records`` with each ``prompt`` replaced by its full conversation: a
    :func:`calc_trace` with probability ``tool_call_share``, else a :func:`direct_answer_trace`.
    The problems do not depend on ``tool_call_share``."""
    if not 0.0 <= tool_call_share <= 1.0:
        raise ValueError(f"tool_call_share must be in [0, 1], got {tool_call_share}")
    records = make_calc_records(num, seed, min_digits=min_digits, max_digits=max_digits, max_ops=max_ops)
    choice = random.Random(f"{seed}/tool_call_share")
    for record in records:
        uses_tool = choice.random() < tool_call_share
        record.prompt = calc_trace(record) if uses_tool else direct_answer_trace(record)
    return records


def make_calc_retry_records(num: int, seed: int = 0) -> list[Record]:
    """``make_calc_records`` whose records name the answer checker (``interaction_kwargs.name:
    checker``, with the ground truth): roll them out with an interaction config that defines it
    (``data/configs/interactions_checker.yaml``). The problems are those of ``calc``."""
    records = make_calc_records(num, seed)
    for record in records:
        record.data_source = "calc-retry"
        record.extra["interaction_kwargs"] = {"name": "checker", "ground_truth": record.ground_truth}
    return records


TASKS: dict[str, Callable[[int, int], list[Record]]] = {
    "calc": make_calc_records,
    "calc-retry": make_calc_retry_records,
}
"""Synthetic tasks by name: ``TASKS[name](num, seed)`` gives ``num`` records."""


def make_task(name: str, num: int, seed: int = 0) -> list[Record]:
    """``num`` records of the task ``name``: a synthetic one, ``reasoning_gym:NAME[,NAME2...]``
    (``data/reasoning_gym.py``) or a step environment ``family:id`` (``data/env_tasks.py``)."""
    from data.env_tasks import is_env_task, make_env_records

    if name.startswith(("reasoning_gym:", "reasoning-gym:")):
        from data.reasoning_gym import make_reasoning_gym_records

        return make_reasoning_gym_records(name.partition(":")[2], num, seed)
    if is_env_task(name):
        return make_env_records(name, num, seed)
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](num, seed)
