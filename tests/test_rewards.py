"""Answer extraction and grading in ``data.rewards``."""

from __future__ import annotations

import threading

import pytest

from data.rewards import answers_equal, extract_answer, extract_boxed, extract_hash_answer, score_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{72}.", "72"),
        ("first \\boxed{1}, then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2^{x}}}", "\\frac{\\sqrt{3}}{2^{x}}"),
        ("$\\boxed{\\{1, 2\\}}$", "\\{1, 2\\}"),
        ("\\fbox{42}", "42"),
        ("\\boxed 72 apples", "72"),
        ("\\boxed{ 5 }", "5"),
    ],
)
def test_extract_boxed_takes_the_last_box_with_nested_braces(text: str, expected: str) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text", ["no box here", "\\boxed{}", "\\boxed{72} and later \\boxed{7", "\\boxed"])
def test_extract_boxed_gives_none_without_a_complete_nonempty_last_box(text: str) -> None:
    assert extract_boxed(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234,567", "1234567"),
        ("#### -3.5\n", "-3.5"),
        ("#### 1\n#### 2", "2"),
        ("#### 9\nThat is all.", "9"),
    ],
)
def test_extract_hash_answer_reads_the_line_after_the_last_marker(text: str, expected: str) -> None:
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize("text", ["72", "####", "####   \n"])
def test_extract_hash_answer_gives_none_without_an_answer(text: str) -> None:
    assert extract_hash_answer(text) is None


def test_extract_answer_prefers_the_box_over_the_hash_marker() -> None:
    assert extract_answer("#### 5\nso \\boxed{6}") == "6"


def test_extract_answer_falls_back_to_the_hash_marker() -> None:
    assert extract_answer("work...\n#### 5") == "5"


def test_extract_answer_gives_none_for_plain_text() -> None:
    assert extract_answer("I think it is 5") is None


@pytest.mark.parametrize(
    ("predicted", "ground_truth"),
    [
        ("72", "72"),
        (" 72 ", "72"),
        ("72.0", "72"),
        ("72.", "72"),
        ("$72$", "72"),
        ("\\$72", "72"),
        ("-5", "-5"),
        ("-5.00", "-5"),
        ("1,234", "1234"),
        ("1,234,567.5", "1234567.5"),
        ("1\\,234", "1234"),
        ("1{,}234", "1234"),
        ("0.5", "1/2"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\\tfrac{3}{4}", "3/4"),
        ("\\frac12", "0.5"),
        ("-\\frac{1}{2}", "-0.5"),
        ("\\frac{-1}{2}", "-1/2"),
        ("6/8", "3/4"),
        ("\\text{72}", "72"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("72 \\text{ dollars}", "72"),
        ("x + 1", "1 + x"),
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
        ("\\{1, 2\\}", "\\{2, 1\\}"),
        ("2^{10}", "1024"),
    ],
)
def test_answers_equal_accepts_the_same_value_written_differently(predicted: str, ground_truth: str) -> None:
    assert answers_equal(predicted, ground_truth)


@pytest.mark.parametrize(
    ("predicted", "ground_truth"),
    [
        ("73", "72"),
        ("-72", "72"),
        ("0.333", "1/3"),
        ("0.33333333", "\\frac{1}{3}"),
        ("7.2", "72"),
        ("1,234", "1,235"),
        ("1/2", "1/3"),
        ("3.14159", "\\pi"),
        ("72 dollars", "72"),
        ("x + 2", "x + 1"),
        ("", "72"),
        ("72", ""),
        ("1/0", "0"),
    ],
)
def test_answers_equal_rejects_near_misses(predicted: str, ground_truth: str) -> None:
    assert not answers_equal(predicted, ground_truth)


@pytest.mark.parametrize(
    "bomb",
    [
        "10^{10^{10}}",
        "2^{2^{2^{2^{5}}}}",
        "1000000!",
        "\\binom{1000000}{500000}",
        "\\binom{10^{6}}{5 \\cdot 10^{5}}",
        "(x+1)^{100000}",
        "9" * 5000,
        "2E+9999999",  # a model's garbage answer; sympy's Float of it took 17 GB
        "2.5 e -99999999",
    ],
)
def test_answers_equal_refuses_answers_too_costly_to_evaluate(bomb: str) -> None:
    assert not answers_equal(bomb, "1")


@pytest.mark.parametrize("junk", [None, 72, ["72"], "\\frac{", "}{", "\\boxed{"])
def test_answers_equal_never_raises(junk: object) -> None:
    assert answers_equal(junk, "72") is False  # type: ignore[arg-type]


def test_answers_equal_works_in_a_worker_thread() -> None:
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(answers_equal("x^2 + 2x + 1", "(x+1)^2")))
    thread.start()
    thread.join()
    assert results == [True]


@pytest.mark.parametrize(
    ("solution_text", "ground_truth", "expected"),
    [
        ("48 + 24 = 72, so the answer is \\boxed{72}.", "72", 1.0),
        ("so \\boxed{72}", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("so \\boxed{0.75}", "\\boxed{\\frac{3}{4}}", 1.0),
        ("so \\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("so \\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("work\n#### 1,234", "1234", 1.0),
        ("\\boxed{71}", "72", 0.0),
        ("the answer is 72", "72", 0.0),
        ("\\boxed{72", "72", 0.0),
        ("\\boxed{}", "72", 0.0),
    ],
)
def test_score_answer_grades_the_extracted_answer(solution_text: str, ground_truth: str, expected: float) -> None:
    assert score_answer(solution_text, ground_truth) == expected
