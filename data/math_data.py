"""MATH (Hendrycks et al.): ``problem``/``solution`` rows -> rallyrl records.

Sources: JSONL, a JSON list, Hugging Face parquet (``problem``, ``solution``, ``level``, ``type``;
MATH-500 adds ``answer``, ``subject``, ``unique_id``) or the original release's directory of one
JSON file per problem. The ground truth is the content of the solution's LAST ``\\boxed{...}`` (or
``\\fbox{...}``), braces balanced (``\\boxed{\\frac{1}{\\sqrt{2}}}`` -> ``\\frac{1}{\\sqrt{2}}``);
when the solution has none, an ``answer`` column is used. A row with neither is skipped and
counted (an error with ``strict``). Each row becomes::

    {"prompt": [{"role": "system", "content": MATH_SYSTEM_PROMPT}, {"role": "user", "content": problem}],
     "data_source": "hendrycks/math", "ground_truth": "\\frac{1}{2}",
     "tools_kwargs": {"answer_check": {"create_kwargs": {"ground_truth": "\\frac{1}{2}"}}},
     "extra": {"split": "test", "index": 0, "solution": "...", "level": "Level 3", "type": "Algebra", ...}}

The module is not named ``math.py``: inside the ``data`` package that name would shadow the
standard library's ``math`` for scripts run from there.
"""

from __future__ import annotations

from pathlib import Path

from data.prep import PrepResult, Row, Skip, infer_split, prepare
from data.rewards import extract_boxed
from data.schema import Layout, Record

MATH_DATA_SOURCE = "hendrycks/math"
MATH_SYSTEM_PROMPT = (
    "You are a careful math solver. Reason step by step. When you have the final answer, submit it with "
    "the answer_check tool if you have it, and end your last message with the final answer in \\boxed{}."
)
_SOURCE_FIELDS = ("problem", "solution", "data_source")


def math_answer(solution: str) -> str | None:
    """The content of the last ``\\boxed{}``/``\\fbox{}`` of ``solution`` (nested braces kept); None if none.

    A last box that never closes gives None, not an earlier box.
    """
    return extract_boxed(solution)


def math_record(row: Row, split: str, data_source: str | None = None) -> Record:
    """One MATH row as a record; ``Skip`` when neither the solution's box nor an ``answer`` gives the answer."""
    problem = row.text("problem")
    solution = row.text("solution")
    ground_truth = math_answer(solution)
    if ground_truth is None:
        answer = row.data.get("answer")
        if isinstance(answer, str | int | float) and not isinstance(answer, bool) and str(answer).strip():
            ground_truth = str(answer).strip()
        else:
            raise Skip("no \\boxed{...} answer in the solution (and no answer field)", field="solution")
    source = data_source or row.text("data_source", required=False) or MATH_DATA_SOURCE
    rest = {key: value for key, value in row.data.items() if key not in _SOURCE_FIELDS}
    return Record(
        prompt=[{"role": "system", "content": MATH_SYSTEM_PROMPT}, {"role": "user", "content": problem.strip()}],
        data_source=source,
        ground_truth=ground_truth,
        tools_kwargs={"answer_check": {"create_kwargs": {"ground_truth": ground_truth}}},
        extra={**rest, "split": split, "index": row.index, "solution": solution, "ability": "math"},
    )


def prepare_math(
    input_path: str | Path,
    output_path: str | Path,
    *,
    split: str | None = None,
    limit: int | None = None,
    strict: bool = False,
    data_source: str | None = None,
    layout: Layout = "native",
) -> PrepResult:
    """Convert a MATH-style file or directory into a records file.

    ``split`` defaults to the one the path names (``MATH/test`` -> ``test``), else ``train``;
    ``limit`` keeps the first rows; ``data_source`` overrides the rows' own (default ``hendrycks/math``).
    Rows without an answer are skipped and counted, or with ``strict`` are an error (nothing written).
    """
    split = split or infer_split(input_path)
    return prepare(
        input_path,
        output_path,
        lambda row: math_record(row, split, data_source),
        limit=limit,
        strict=strict,
        layout=layout,
    )
