"""Dataset preparation: official GSM8K and MATH files -> records, verl's GSM8K parquet as it is, errors for people."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from data.gsm8k import GSM8K_DATA_SOURCE, make_gsm8k_like, prepare_gsm8k
from data.math_data import MATH_DATA_SOURCE, math_answer, prepare_math
from data.prep import infer_split
from data.schema import RecordError, load_records


def _jsonl(path: Path, rows: list[Any]) -> Path:
    """Each row is dumped as JSON, except bytes, written as they are (a blank line: b"")."""
    path.write_bytes(b"".join((row if isinstance(row, bytes) else orjson.dumps(row)) + b"\n" for row in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GSM8K_ROWS = [
    {"question": "Tom has 3 bags of 24 apples. How many apples?", "answer": "3*24 = <<3*24=72>>72\n#### 72"},
    {"question": "A farm sells 500 eggs twice. How many eggs?", "answer": "2*500 = <<2*500=1000>>1000\n#### 1,000"},
]

MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Find $x$.", "solution": "First $\\boxed{3}$ is wrong; so $x = \\boxed{\\sqrt{\\frac{1}{2}}}$.",
     "level": "Level 5", "type": "Algebra"},
    {"problem": "What set?", "solution": "The set is \\fbox{\\{1, 2\\}}.", "level": "Level 2", "type": "Algebra"},
    {"problem": "No answer here.", "solution": "We give up.", "level": "Level 3", "type": "Geometry"},
]  # fmt: skip


def _verl_gsm8k_row(idx: int, question: str, solution: str) -> dict[str, Any]:
    """A row as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "You are a math expert. Use calc_gsm8k_reward. Answer as #### <answer>."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": "test", "index": idx, "answer": f"... #### {solution}", "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    }  # fmt: skip


# --- GSM8K ------------------------------------------------------------------------------------


def test_gsm8k_official_jsonl_becomes_records_for_the_answer_check_tool(tmp_path: Path) -> None:
    result = prepare_gsm8k(_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS), tmp_path / "out.jsonl")
    assert (result.written, result.skipped) == (2, [])
    records = load_records(tmp_path / "out.jsonl")
    first = records[0]
    assert [m["role"] for m in first.prompt] == ["system", "user"]
    assert "answer_check" in first.prompt[0]["content"] and "\\boxed{}" in first.prompt[0]["content"]
    assert first.prompt[1]["content"] == GSM8K_ROWS[0]["question"]
    assert first.data_source == GSM8K_DATA_SOURCE == "openai/gsm8k"
    assert first.ground_truth == "72"
    assert first.tools_kwargs == {"answer_check": {"create_kwargs": {"ground_truth": "72"}}}
    assert first.extra == {"split": "train", "index": 0, "answer": GSM8K_ROWS[0]["answer"], "ability": "math"}


def test_gsm8k_answer_loses_its_thousands_commas(tmp_path: Path) -> None:
    prepare_gsm8k(_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS), tmp_path / "out.jsonl")
    record = load_records(tmp_path / "out.jsonl")[1]
    assert record.ground_truth == "1000"
    assert record.tools_kwargs["answer_check"]["create_kwargs"]["ground_truth"] == "1000"


def test_gsm8k_hugging_face_parquet_gives_the_same_records_as_jsonl(tmp_path: Path) -> None:
    prepare_gsm8k(_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS), tmp_path / "a.jsonl")
    prepare_gsm8k(_parquet(tmp_path / "test-00000-of-00001.parquet", GSM8K_ROWS), tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert load_records(tmp_path / "b.jsonl")[0].extra["split"] == "test"


def test_gsm8k_split_option_and_limit(tmp_path: Path) -> None:
    result = prepare_gsm8k(_jsonl(tmp_path / "x.jsonl", GSM8K_ROWS), tmp_path / "out.jsonl", split="dev", limit=1)
    assert result.written == 1
    [record] = load_records(tmp_path / "out.jsonl")
    assert record.extra["split"] == "dev"


@pytest.mark.parametrize(
    ("path", "split"),
    [("gsm8k/test.jsonl", "test"), ("main/train-00000-of-00001.parquet", "train"), ("MATH/test/algebra", "test"),
     ("math_val.jsonl", "validation"), ("problems.jsonl", "train")],
)  # fmt: skip
def test_split_is_read_from_the_path(path: str, split: str) -> None:
    assert infer_split(path) == split


def test_gsm8k_output_in_verl_layout_loads_back_as_the_same_records(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    prepare_gsm8k(source, tmp_path / "native.jsonl")
    prepare_gsm8k(source, tmp_path / "verl.parquet", layout="verl")
    row = pq.read_table(tmp_path / "verl.parquet").to_pylist()[0]
    assert row["ability"] == "math" and row["reward_model"]["ground_truth"] == "72"
    assert row["extra_info"]["tools_kwargs"]["answer_check"]["create_kwargs"]["ground_truth"] == "72"
    assert load_records(tmp_path / "verl.parquet") == load_records(tmp_path / "native.jsonl")


def test_gsm8k_row_without_hash_answer_names_file_line_and_field(tmp_path: Path) -> None:
    rows = [GSM8K_ROWS[0], b"  ", {"question": "q?", "answer": "The answer is 5."}]
    source = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(RecordError) as info:
        prepare_gsm8k(source, tmp_path / "out.jsonl")
    assert (info.value.line, info.value.index, info.value.field) == (3, 1, "answer")
    assert str(info.value).startswith(f"{source} line 3 (record 1), field answer: no final answer line '####")
    assert not (tmp_path / "out.jsonl").exists()


def test_gsm8k_empty_hash_answer_is_an_error(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "train.jsonl", [{"question": "q?", "answer": "so\n####  "}])
    with pytest.raises(RecordError, match="nothing after '####'"):
        prepare_gsm8k(source, tmp_path / "out.jsonl")


def test_gsm8k_missing_column_in_parquet_names_the_row_and_field(tmp_path: Path) -> None:
    source = _parquet(tmp_path / "train.parquet", [{"question": "q?", "solution": "#### 1"}])
    with pytest.raises(RecordError) as info:
        prepare_gsm8k(source, tmp_path / "out.jsonl")
    assert str(info.value) == f"{source} record 0, field answer: missing; the row has question, solution"


def test_gsm8k_field_of_the_wrong_type_is_an_error(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "train.jsonl", [{"question": 7, "answer": "#### 7"}])
    with pytest.raises(RecordError, match="field question: expected a string, got int"):
        prepare_gsm8k(source, tmp_path / "out.jsonl")


def test_already_prepared_file_is_pointed_to_data(tmp_path: Path) -> None:
    source = _parquet(tmp_path / "train.parquet", [_verl_gsm8k_row(0, "q?", "2")])
    with pytest.raises(RecordError, match=r"already prepared record .* pass the file to --data as it is"):
        prepare_gsm8k(source, tmp_path / "out.jsonl")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("absent.jsonl", None, "file not found"), ("bad.jsonl", b'{"question": "q"\n', "line 1: invalid JSON"),
     ("bad.parquet", b"not parquet", "cannot read parquet"), ("data.csv", b"a,b\n", "unsupported input type '.csv'")],
)  # fmt: skip
def test_unreadable_input_is_an_error_naming_the_file(tmp_path: Path, name: str, content: bytes | None,
                                                      message: str) -> None:  # fmt: skip
    source = tmp_path / name
    if content is not None:
        source.write_bytes(content)
    with pytest.raises(RecordError) as info:
        prepare_gsm8k(source, tmp_path / "out.jsonl")
    assert str(info.value).startswith(str(source)) and message in str(info.value)


def test_failed_preparation_leaves_an_existing_output_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    source = _jsonl(tmp_path / "train.jsonl", [*GSM8K_ROWS, {"question": "q?"}])
    with pytest.raises(RecordError):
        prepare_gsm8k(source, out)
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "train.jsonl"]


def test_output_must_not_be_the_input(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    with pytest.raises(RecordError, match="the output is the input file"):
        prepare_gsm8k(source, source)


def test_verl_gsm8k_parquet_loads_as_it_is(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "test.parquet", [_verl_gsm8k_row(0, "1+1?", "2"), _verl_gsm8k_row(1, "2*3?", "6")])
    records = load_records(path)
    assert [r.ground_truth for r in records] == ["2", "6"]
    assert records[1].tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "6"}}}
    assert records[1].extra["ability"] == "math" and records[1].extra["interaction_kwargs"]["query"] == "2*3?"
    assert records[1].extra["reward_model"] == {"style": "rule"}


# --- made-up GSM8K-like data --------------------------------------------------------------------


def test_make_gsm8k_like_writes_official_rows_whose_arithmetic_is_right(tmp_path: Path) -> None:
    rows = make_gsm8k_like(200, seed=3, path=tmp_path / "train.jsonl")
    assert [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()] == rows
    for row in rows:
        assert set(row) == {"question", "answer"}
        *steps, last = row["answer"].split("\n")
        for expression, value in re.findall(r"<<([^=]+)=([^>]+)>>", "\n".join(steps)):
            assert eval(expression) == int(value)  # the notes are plain integer arithmetic
        assert last.replace(",", "") == f"#### {value}"
    assert any("," in row["answer"].split("####")[1] for row in rows)


def test_make_gsm8k_like_is_seeded_and_extends_with_n() -> None:
    assert make_gsm8k_like(20, seed=1) == make_gsm8k_like(20, seed=1)
    assert make_gsm8k_like(30, seed=1)[:20] == make_gsm8k_like(20, seed=1)
    assert make_gsm8k_like(20, seed=1) != make_gsm8k_like(20, seed=2)


# --- MATH -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("solution", "answer"),
    [("so $\\boxed{\\frac{1}{\\sqrt{2}}}$.", "\\frac{1}{\\sqrt{2}}"), ("\\boxed{1} then \\boxed{2}", "2"),
     ("\\fbox{\\{a\\}}", "\\{a\\}"), ("\\boxed {(1, 2)}", "(1, 2)"), ("\\boxed{3} and \\boxed{4", None),
     ("no box", None)],
)  # fmt: skip
def test_math_answer_is_the_last_box_with_balanced_braces(solution: str, answer: str | None) -> None:
    assert math_answer(solution) == answer


def test_math_rows_become_records_and_unanswered_ones_are_skipped(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "test.jsonl", MATH_ROWS)
    result = prepare_math(source, tmp_path / "out.jsonl")
    assert result.written == 3
    assert result.skipped == [(f"{source} line 4, field solution", "no \\boxed{...} answer in the solution (and no "
                                                                  "answer field)")]  # fmt: skip
    records = load_records(tmp_path / "out.jsonl")
    assert [r.ground_truth for r in records] == ["\\frac{1}{2}", "\\sqrt{\\frac{1}{2}}", "\\{1, 2\\}"]
    assert [r.extra["index"] for r in records] == [0, 1, 2]
    second = records[1]
    assert second.data_source == MATH_DATA_SOURCE
    assert second.prompt[1]["content"] == "Find $x$." and "\\boxed{}" in second.prompt[0]["content"]
    assert second.tools_kwargs == {"answer_check": {"create_kwargs": {"ground_truth": "\\sqrt{\\frac{1}{2}}"}}}
    assert second.extra == {"level": "Level 5", "type": "Algebra", "split": "test", "index": 1,
                            "solution": MATH_ROWS[1]["solution"], "ability": "math"}  # fmt: skip


def test_math_strict_makes_an_unanswered_row_an_error_and_writes_nothing(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "test.jsonl", MATH_ROWS)
    with pytest.raises(RecordError) as info:
        prepare_math(source, tmp_path / "out.jsonl", strict=True)
    assert (info.value.line, info.value.field) == (4, "solution")
    assert not (tmp_path / "out.jsonl").exists()


def test_math_file_whose_rows_are_all_skipped_is_an_error(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "test.jsonl", MATH_ROWS[3:])
    with pytest.raises(RecordError, match="nothing to write: all 1 rows were skipped"):
        prepare_math(source, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_math_answer_column_is_used_when_the_solution_has_no_box(tmp_path: Path) -> None:
    row = {"problem": "p", "solution": "It is five.", "answer": "5", "subject": "Algebra", "level": 2,
           "unique_id": "test/algebra/1.json"}  # fmt: skip
    prepare_math(_parquet(tmp_path / "math500.parquet", [row]), tmp_path / "out.jsonl", strict=True)
    [record] = load_records(tmp_path / "out.jsonl")
    assert record.ground_truth == "5" and record.extra["unique_id"] == "test/algebra/1.json"


def test_math_data_source_comes_from_the_row_or_the_option(tmp_path: Path) -> None:
    rows = [{**MATH_ROWS[0], "data_source": "DigitalLearningGmbH/MATH-lighteval"}, MATH_ROWS[1]]
    source = _jsonl(tmp_path / "train.jsonl", rows)
    prepare_math(source, tmp_path / "a.jsonl")
    assert [r.data_source for r in load_records(tmp_path / "a.jsonl")] == [rows[0]["data_source"], MATH_DATA_SOURCE]
    prepare_math(source, tmp_path / "b.jsonl", data_source="math500")
    assert {r.data_source for r in load_records(tmp_path / "b.jsonl")} == {"math500"}


def test_math_original_release_directory_of_json_files(tmp_path: Path) -> None:
    for i, (subject, row) in enumerate(zip(["algebra", "algebra", "geometry"], MATH_ROWS, strict=False)):
        (tmp_path / "MATH" / "test" / subject).mkdir(parents=True, exist_ok=True)
        (tmp_path / "MATH" / "test" / subject / f"{i}.json").write_bytes(orjson.dumps(row))
    result = prepare_math(tmp_path / "MATH" / "test", tmp_path / "out.jsonl", limit=2)
    records = load_records(tmp_path / "out.jsonl")
    assert result.written == 2 and [r.extra["split"] for r in records] == ["test", "test"]
    assert [r.ground_truth for r in records] == ["\\frac{1}{2}", "\\sqrt{\\frac{1}{2}}"]


def test_math_error_in_a_directory_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "MATH").mkdir()
    (tmp_path / "MATH" / "1.json").write_bytes(orjson.dumps({"problem": "p"}))
    with pytest.raises(RecordError, match=r"MATH/1\.json record 0, field solution: missing"):
        prepare_math(tmp_path / "MATH", tmp_path / "out.jsonl")


# --- the command line --------------------------------------------------------------------------


def test_cli_data_gsm8k_prints_a_summary(tmp_path: Path) -> None:
    source = make_gsm8k_like(5, seed=0, path=tmp_path / "train.jsonl")
    done = run_cli("data", "gsm8k", "--input", str(tmp_path / "train.jsonl"), "--output", str(tmp_path / "o.jsonl"))
    assert done.returncode == 0, done.stderr
    assert f"wrote 5 records to {tmp_path / 'o.jsonl'}; skipped 0" in done.stderr.replace("\n", "")
    assert len(load_records(tmp_path / "o.jsonl")) == len(source)


def test_cli_data_gsm8k_bad_record_exits_2_naming_the_place(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "train.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "5"}])
    done = run_cli("data", "gsm8k", "-i", str(source), "-o", str(tmp_path / "o.jsonl"))
    assert done.returncode == 2
    assert "line 2 (record 1), field answer: no final answer line" in done.stderr.replace("\n", "")
    assert "Traceback" not in done.stderr and not (tmp_path / "o.jsonl").exists()


def test_cli_data_math_reports_skipped_rows_and_strict_fails(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "test.jsonl", MATH_ROWS)
    done = run_cli("data", "math", "-i", str(source), "-o", str(tmp_path / "o.parquet"))
    assert done.returncode == 0, done.stderr
    assert "wrote 3 records" in done.stderr and "skipped 1" in done.stderr
    assert len(load_records(tmp_path / "o.parquet")) == 3
    strict = run_cli("data", "math", "-i", str(source), "-o", str(tmp_path / "s.jsonl"), "--strict")
    assert strict.returncode == 2 and "field solution" in strict.stderr


@pytest.mark.slow
def test_cli_eval_runs_on_prepared_gsm8k(tmp_path: Path, tiny_model_dir: Path) -> None:
    make_gsm8k_like(3, seed=0, path=tmp_path / "test.jsonl")
    assert run_cli("data", "gsm8k", "-i", str(tmp_path / "test.jsonl"), "-o", str(tmp_path / "d.jsonl")).returncode == 0
    done = run_cli("eval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "d.jsonl"), "-n", "1",
                   "--max-turns", "1", "--max-new-tokens", "4", "--json", str(tmp_path / "e.json"),
                   "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "e.json").read_text())["prompts"] == 3


@pytest.mark.slow
def test_cli_rollout_runs_on_verl_gsm8k_parquet(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _parquet(tmp_path / "test.parquet", [_verl_gsm8k_row(0, "1+1?", "2"), _verl_gsm8k_row(1, "2*3?", "6")])
    out = tmp_path / "r.jsonl"
    done = run_cli("rollout", "--model", str(tiny_model_dir), "--data", str(path), "--out", str(out),
                   "--max-turns", "1", "--max-new-tokens", "4", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    trajectories = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["ground_truth"] for t in trajectories] == ["2", "6"]
    assert {t["data_source"] for t in trajectories} == {"openai/gsm8k"}


@pytest.mark.slow
def test_verl_gsm8k_parquet_rolls_out_with_the_shipped_verl_tool_config(tmp_path: Path) -> None:
    """verl names the answer tool calc_gsm8k_reward; data/assets/tools/verl_gsm8k.yaml maps it to answer_check."""
    rows = [_verl_gsm8k_row(i, f"What is {i} + {i}?", str(2 * i)) for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    tools = Path(__file__).resolve().parents[1] / "data" / "assets" / "tools" / "verl_gsm8k.yaml"
    out = tmp_path / "out.jsonl"
    made = run_cli("rollout", "--data", str(tmp_path / "verl.parquet"), "--tools", str(tools), "--out", str(out),
                   "--max-turns", "2", "--max-new-tokens", "48", "--no-progress")  # fmt: skip
    assert made.returncode == 0, made.stderr
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(lines) == 3
    assert all(line["finish_reason"] != "error" for line in lines), [line["error"] for line in lines]
