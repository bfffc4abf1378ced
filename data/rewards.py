"""Final-answer extraction and grading: ``\\boxed{}`` / ``####`` answers, exact numbers, math-verify.

``score_answer(solution_text, ground_truth)`` is the whole pipeline: extract the solution's
answer, extract the ground truth's when it carries a marker, and compare with ``answers_equal``.

``answers_equal`` first tries an exact path: both sides normalised and, when both are plain
numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``), compared as ``fractions.Fraction`` so
``0.5 == 1/2 == \\frac{1}{2}`` and ``0.333 != 1/3``. Anything else goes to math-verify with its
signal-based timeouts disabled (``signal.alarm`` fails outside the main thread, and rollouts
grade from worker threads). Without a timeout a pathological answer could keep sympy busy for
minutes, so inputs are capped in length and parsed expressions whose constant powers or
factorials would be enormous (or whose symbolic powers would take ages to expand) are refused
before ``verify`` evaluates them. ``parse`` itself evaluates binomials eagerly, so a text with
``\\binom`` followed anywhere by a 5-digit number or a power is refused before parsing.
"""

from __future__ import annotations

import logging
import math
import re
from fractions import Fraction
from typing import Any

MAX_ANSWER_CHARS = 1000
"""Longer answers (after normalisation) are never equal: no exact parse, no math-verify."""
MAX_POWER_BITS = 100_000
"""A constant power (``a^b``) whose value would need more bits than this is not evaluated."""
MAX_SYMBOLIC_EXPONENT = 100
"""A power of a symbolic base (``(x+1)^n``) with a constant exponent above this is not compared."""
MAX_COMBINATORIAL_ARG = 10_000
"""A factorial or binomial with a constant argument above this is not evaluated."""

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_WRAPPERS = ("\\boxed", "\\fbox", "\\text", "\\textbf", "\\mathrm", "\\mathbf")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_SLASH_RE = re.compile(rf"({_NUMBER})/({_NUMBER})")
_LATEX_FRAC_RE = re.compile(rf"([-+]?)\\[dt]?frac(?:\{{({_NUMBER})\}}\{{({_NUMBER})\}}|(\d)(\d))")
_BIG_BINOMIAL_RE = re.compile(r"(?:binom|choose).*(?:\d{5}|\^)", re.DOTALL)
_HUGE_EXPONENT_RE = re.compile(r"\d\.?\s*[eE]\s*[+-]?\s*\d{4,}")
"""Scientific notation with a 4-digit exponent: sympy turns ``2E+99999999`` into an exact rational
first, which takes gigabytes (a model's garbage answer once took 17 GB)."""


class _DisabledTimeoutWarning(logging.Filter):
    """Drop math-verify's "Timeout is disabled" warning: the guards above stand in for its timeouts."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DisabledTimeoutWarning())


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``open_index`` (escaped braces skipped), else None."""
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _boxed_span(text: str) -> tuple[int, int, str] | None:
    """Start, end and content of the last ``\\boxed``/``\\fbox`` in ``text``, or None if malformed."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    start, i = matches[-1].start(), matches[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        close = _closing_brace(text, i)
        if close is None:
            return None
        return start, close + 1, text[i + 1 : close]
    if i > matches[-1].end():  # "\boxed 72": the token after the space
        token = re.match(r"[^\s$]+", text[i:])
        if token:
            return start, i + token.end(), token.group()
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), stripped; None if none or empty.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``). A last box that never closes
    (a truncated answer) gives None rather than an earlier box.
    """
    span = _boxed_span(text)
    if span is None:
        return None
    return span[2].strip() or None


def extract_hash_answer(text: str) -> str | None:
    """GSM8K style: the rest of the line after the last ``####``, stripped, ``1,234`` -> ``1234``."""
    index = text.rfind("####")
    if index < 0:
        return None
    rest = text[index + 4 :].strip()
    line = rest.splitlines()[0].strip() if rest else ""
    line = re.sub(r"(?<=\d),(?=\d)", "", line)
    return line or None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last ``\\boxed{}``, else the ``####`` line, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    return extract_hash_answer(text)


def reference_answer(ground_truth: str) -> str:
    """The answer in a ground truth: extracted when it has ``####`` or ``\\boxed``, else the text stripped."""
    if "####" in ground_truth or _BOX_RE.search(ground_truth):
        extracted = extract_answer(ground_truth)
        if extracted is not None:
            return extracted
    return ground_truth.strip()


def _unwrap(text: str, command: str) -> str | None:
    """The argument of ``\\command{...}`` when that call is the whole of ``text``, else None."""
    if not text.startswith(command):
        return None
    rest = text[len(command) :].lstrip(" ")
    if not rest.startswith("{"):
        return None
    offset = len(text) - len(rest)
    if _closing_brace(text, offset) != len(text) - 1:
        return None
    return text[offset + 1 : -1]


def normalize_answer(text: str) -> str:
    """Strip what does not change an answer's value: spaces, ``$``, a final ``.``, LaTeX spacing,
    thousands commas and a ``\\boxed{}`` / ``\\text{}`` wrapping the whole answer."""
    text = text.replace("\\$", "").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    previous = None
    while text != previous:
        previous = text
        text = text.strip().strip("$").strip()
        if text.endswith("."):
            text = text[:-1]
        for command in _WRAPPERS:
            inner = _unwrap(text, command)
            if inner is not None:
                text = inner
                break
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    return text


def exact_number(text: str) -> Fraction | None:
    """The exact value of a normalised plain number, ``a/b`` or ``\\frac{a}{b}``; None for anything else."""
    text = re.sub(r"\s+", "", text)
    if len(text) > MAX_ANSWER_CHARS:
        return None
    if _NUMBER_RE.fullmatch(text):
        return Fraction(text)
    if match := _SLASH_RE.fullmatch(text):
        numerator, denominator = Fraction(match[1]), Fraction(match[2])
    elif match := _LATEX_FRAC_RE.fullmatch(text):
        numerator = Fraction(match[2] or match[4]) * (-1 if match[1] == "-" else 1)
        denominator = Fraction(match[3] or match[5])
    else:
        return None
    if denominator == 0:
        return None
    return numerator / denominator


def _is_safe(expr: Any) -> bool:
    """False when evaluating ``expr`` could mean a huge power or factorial (checked innermost first)."""
    from sympy import Basic, Pow
    from sympy.functions.combinatorial.factorials import CombinatorialFunction
    from sympy.matrices import MatrixBase

    if isinstance(expr, MatrixBase):
        return all(_is_safe(element) for element in expr)
    if not isinstance(expr, Basic):
        return True
    if not all(_is_safe(arg) for arg in expr.args):
        return False
    if isinstance(expr, Pow) and expr.exp.is_number:
        exponent = abs(complex(expr.exp.evalf(20)))
        if not expr.base.is_number:
            return exponent <= MAX_SYMBOLIC_EXPONENT
        base = abs(complex(expr.base.evalf(20)))
        bits = exponent * max(1.0, abs(math.log2(base)) if base > 0 else 1.0)
        return math.isfinite(bits) and bits <= MAX_POWER_BITS
    if isinstance(expr, CombinatorialFunction):
        return all(not arg.is_number or abs(complex(arg.evalf(20))) <= MAX_COMBINATORIAL_ARG for arg in expr.args)
    return True


def _math_verify_equal(predicted: str, ground_truth: str) -> bool:
    """math-verify's verdict on two normalised answers, each wrapped in ``$...$``; timeouts disabled.
    math-verify and sympy load here, on first use: they take most of a second to import, which every
    ``rallyrl`` process would pay."""
    from math_verify import parse, verify

    for text in (predicted, ground_truth):
        if len(text) > MAX_ANSWER_CHARS or _BIG_BINOMIAL_RE.search(text) or _HUGE_EXPONENT_RE.search(text):
            return False
    gold = parse(f"${ground_truth}$", parsing_timeout=None)
    target = parse(f"${predicted}$", parsing_timeout=None)
    if not gold or not target or not all(_is_safe(expr) for expr in (*gold, *target)):
        return False
    return bool(verify(gold, target, timeout_seconds=None))


def answers_equal(predicted: str, ground_truth: str) -> bool:
    """Whether ``predicted`` has the value of ``ground_truth`` (both bare answers). Never raises.

    Plain numbers compare exactly (``12 == 12.0``, ``0.5 == \\frac{1}{2}``, ``0.333 != 1/3``);
    anything else (expressions, sets, units in ``\\text{}``) is left to math-verify.
    """
    try:
        predicted, ground_truth = normalize_answer(predicted), normalize_answer(ground_truth)
        if not predicted or not ground_truth:
            return False
        if predicted == ground_truth:
            return True
        predicted_value, truth_value = exact_number(predicted), exact_number(ground_truth)
        if predicted_value is not None and truth_value is not None:
            return predicted_value == truth_value
        return _math_verify_equal(predicted, ground_truth)
    except Exception:
        return False


def score_answer(solution_text: str, ground_truth: str) -> float:
    """1.0 when the solution's final answer equals the ground truth, else 0.0 (also when none is found).

    ``ground_truth`` is a bare value (``"72"``, ``"\\frac{3}{4}"``) or a text with ``#### 72`` or
    ``\\boxed{72}`` in it, in which case its marked answer is used.
    """
    try:
        answer = extract_answer(solution_text)
        if answer is None:
            return 0.0
        return 1.0 if answers_equal(answer, reference_answer(str(ground_truth))) else 0.0
    except Exception:
        return 0.0
