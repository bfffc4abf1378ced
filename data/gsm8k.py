"""GSM8K: the official files -> rallyrl records, and made-up GSM8K-like files for tests and benchmarks.

The official release (``grade-school-math/.../train.jsonl``, or Hugging Face's ``openai/gsm8k``
parquet) has one ``question`` and one ``answer`` per row; the answer is the reference solution,
its last line ``#### 72``. Each row becomes::

    {"prompt": [{"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": question}],
     "data_source": "openai/gsm8k", "ground_truth": "72",
     "tools_kwargs": {"answer_check": {"create_kwargs": {"ground_truth": "72"}}},
     "extra": {"split": "train", "index": 0, "answer": "<the reference solution>", "ability": "math"}}

``ground_truth`` is the text after ``####`` with thousands commas removed (``1,000`` -> ``1000``).
verl's own preprocessed GSM8K parquet needs no conversion: ``load_records`` reads it as it is.
"""

from __future__ import annotations

import random
from pathlib import Path

import orjson

from data.files import atomic_write_bytes
from data.prep import PrepResult, Row, infer_split, prepare
from data.rewards import extract_hash_answer
from data.schema import Layout, Record

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_SYSTEM_PROMPT = (
    "You are a careful math solver. Reason step by step. When you have the final answer (a number), "
    "submit it with the answer_check tool if you have it, and end your last message with the final "
    "answer in \\boxed{}."
)


def gsm8k_record(row: Row, split: str) -> Record:
    """One official GSM8K row (``question``, ``answer`` ending in ``#### N``) as a record."""
    question = row.text("question")
    answer = row.text("answer")
    if "####" not in answer:
        raise row.error("no final answer line '#### <number>' in the reference solution", field="answer")
    ground_truth = extract_hash_answer(answer)
    if ground_truth is None:
        raise row.error("nothing after '####'; expected the final answer, like '#### 72'", field="answer")
    return Record(
        prompt=[{"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": question.strip()}],
        data_source=GSM8K_DATA_SOURCE,
        ground_truth=ground_truth,
        tools_kwargs={"answer_check": {"create_kwargs": {"ground_truth": ground_truth}}},
        extra={"split": split, "index": row.index, "answer": answer, "ability": "math"},
    )


def prepare_gsm8k(
    input_path: str | Path,
    output_path: str | Path,
    *,
    split: str | None = None,
    limit: int | None = None,
    layout: Layout = "native",
) -> PrepResult:
    """Convert an official GSM8K file (``.jsonl``/``.json``/``.parquet``) into a records file.

    ``split`` defaults to the one the path names (``test.jsonl`` -> ``test``), else ``train``;
    ``limit`` keeps the first rows. A row without ``question``/``answer`` or without ``####`` is
    an error naming file, line and field, and nothing is written.
    """
    split = split or infer_split(input_path)
    return prepare(input_path, output_path, lambda row: gsm8k_record(row, split), limit=limit, layout=layout)


# ---------------------------------------------------------------------------------------------
# Made-up GSM8K-like data (the official format, simple arithmetic word problems)

_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy")
_ITEMS = ("apples", "clips", "marbles", "stickers", "books", "pencils", "cookies", "stamps")


def make_gsm8k_like(n: int, seed: int = 0, path: str | Path | None = None) -> list[dict[str, str]]:
    """``n`` made-up word problems in the official GSM8K layout (``question``, ``answer`` ending in
    ``#### N``, ``<<a*b=c>>`` calculator notes), written as JSONL to ``path`` when given.

    The same seed gives the same rows; a larger ``n`` extends them. Answers of 1,000 and more are
    sometimes written with a thousands comma, as a few official ones are.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows = [_word_problem(rng) for _ in range(n)]
    if path is not None:
        atomic_write_bytes(path, b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return rows


def _word_problem(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 500), rng.randint(2, 500)
        c = a + b
        question = f"{name} has {a} {item}. A friend gives {name} {b} more. How many {item} does {name} have now?"
        steps = [f"{name} has {a}+{b} = <<{a}+{b}={c}>>{c} {item} now."]
    elif kind == 1:
        a = rng.randint(20, 900)
        b = rng.randint(1, a - 1)
        c = a - b
        question = f"{name} had {a} {item} and gave away {b} of them. How many {item} does {name} have left?"
        steps = [f"{name} has {a}-{b} = <<{a}-{b}={c}>>{c} {item} left."]
    elif kind == 2:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        c = a * b
        question = f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} buy?"
        steps = [f"{name} buys {a}*{b} = <<{a}*{b}={c}>>{c} {item}."]
    elif kind == 3:
        b, c = rng.randint(2, 12), rng.randint(2, 40)
        a = b * c
        question = f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"
        steps = [f"Each friend gets {a}/{b} = <<{a}/{b}={c}>>{c} {item}."]
    else:
        a, b, d = rng.randint(5, 40), rng.randint(2, 10), rng.randint(2, 30)
        e = a * b
        c = e * d
        question = (f"{name} earns ${a} an hour and works {b} hours a day. How much money does {name} earn "
                    f"in {d} days?")  # fmt: skip
        steps = [f"{name} earns {a}*{b} = $<<{a}*{b}={e}>>{e} a day.",
                 f"In {d} days {name} earns {e}*{d} = $<<{e}*{d}={c}>>{c}."]  # fmt: skip
    shown = f"{c:,}" if c >= 1000 and rng.random() < 0.5 else str(c)
    return {"question": question, "answer": "\n".join([*steps, f"#### {shown}"])}
