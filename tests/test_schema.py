"""The dataset record format: native JSONL/JSON/parquet, verl's parquet layout, and errors for people."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.schema import Record, RecordError, load_records, save_records, validate_record


def _messages(question: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Use the calculator tool."},
        {"role": "user", "content": question},
    ]


def _records() -> list[Record]:
    return [
        Record(
            prompt=_messages("What is 12*34?"),
            data_source="calc",
            ground_truth="408",
            tools_kwargs={"answer_check": {"create_kwargs": {"ground_truth": "408"}}},
            extra={"expression": "12*34"},
            index=0,
        ),
        Record(
            prompt=_messages("Say hi."),
            data_source="chat",
            ground_truth=None,
            tools_kwargs={},
            extra={"tags": ["a", "b"], "score": 0.5},
            index=1,
        ),
        Record(
            prompt=_messages("What is 2+2?"),
            ground_truth="4",
            tools_kwargs={"calculator": {"execute_kwargs": {"precision": 3}, "release_kwargs": {}}},
            index=2,
        ),
    ]


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Each item is a JSON value (dumped) or a raw string (written as is)."""
    text = "\n".join(line if isinstance(line, str) else orjson.dumps(line).decode() for line in lines)
    path.write_text(text + "\n")
    return path


def _gsm8k_verl_row(idx: int, question: str, solution: str) -> dict[str, Any]:
    """A row as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "You are a math expert. Call calc_gsm8k_reward to check."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": "train",
            "index": idx,
            "answer": f"... #### {solution}",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
        },
    }


GOOD = {"prompt": [{"role": "user", "content": "hi"}]}


# --- round trips ------------------------------------------------------------------------------


def test_jsonl_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    save_records(_records(), path)
    assert load_records(path) == _records()


def test_jsonl_file_holds_one_native_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    save_records(_records(), path)
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line) for line in lines] == [record.to_dict() for record in _records()]
    assert set(orjson.loads(lines[0])) == {"prompt", "data_source", "ground_truth", "tools_kwargs", "extra"}


def test_jsonl_blank_lines_are_skipped_and_index_counts_records(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "gaps.jsonl", [GOOD, "", "   ", GOOD])
    records = load_records(path)
    assert [record.index for record in records] == [0, 1]


def test_json_list_loads_in_order(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    path.write_bytes(orjson.dumps([record.to_dict() for record in _records()]))
    assert load_records(path) == _records()


def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    save_records(_records(), path)
    assert load_records(path) == _records()


def test_parquet_round_trip_native_layout(tmp_path: Path) -> None:
    path = tmp_path / "records.parquet"
    save_records(_records(), path)
    assert load_records(path) == _records()


def test_verl_gsm8k_parquet_loads_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    rows = [_gsm8k_verl_row(0, "Tom has 3 apples...", "72"), _gsm8k_verl_row(1, "A train goes...", "10")]
    pq.write_table(pa.Table.from_pylist(rows), path)

    first, second = load_records(path)

    assert first.prompt == rows[0]["prompt"]
    assert first.data_source == "openai/gsm8k"
    assert first.ground_truth == "72"
    assert first.tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    assert first.extra == {
        "ability": "math",
        "reward_model": {"style": "rule"},
        "split": "train",
        "index": 0,
        "answer": "... #### 72",
        "question": "Tom has 3 apples...",
        "need_tools_kwargs": True,
    }
    assert (second.index, second.ground_truth) == (1, "10")


def test_verl_parquet_fillers_for_other_records_tools_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "mixed.parquet"
    search_row = _gsm8k_verl_row(1, "Who wrote Hamlet?", "Shakespeare")
    search_row["extra_info"]["tools_kwargs"] = {"search": {"execute_kwargs": {"top_k": 3}}}
    pq.write_table(pa.Table.from_pylist([_gsm8k_verl_row(0, "1+1?", "2"), search_row]), path)

    math_record, search_record = load_records(path)

    assert math_record.tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}}
    assert search_record.tools_kwargs == {"search": {"execute_kwargs": {"top_k": 3}}}


def test_verl_layout_save_is_read_by_pyarrow_as_verl_expects(tmp_path: Path) -> None:
    path = tmp_path / "calc.parquet"
    save_records(_records()[:1], path, layout="verl")
    row = pq.read_table(path).to_pylist()[0]
    assert row["reward_model"]["ground_truth"] == "408"
    assert row["extra_info"]["tools_kwargs"]["answer_check"]["create_kwargs"] == {"ground_truth": "408"}
    assert row["extra_info"]["expression"] == "12*34"


def test_verl_layout_round_trip(tmp_path: Path) -> None:
    records = [Record(prompt=_messages(q), ground_truth=gt, extra={"k": q}) for q, gt in [("a", "1"), ("b", "2")]]
    for index, record in enumerate(records):
        record.index = index
    path = tmp_path / "records.parquet"
    save_records(records, path, layout="verl")
    assert load_records(path) == records


def test_verl_record_saved_in_verl_layout_gives_the_same_row() -> None:
    row = _gsm8k_verl_row(3, "How many?", "5")
    assert validate_record(row).to_verl_dict() == row


# --- how records are read ---------------------------------------------------------------------


def test_native_keys_win_over_verl_keys() -> None:
    row = _gsm8k_verl_row(0, "q", "72")
    row["ground_truth"] = "73"
    row["tools_kwargs"] = {"calculator": {}}
    record = validate_record(row)
    assert record.ground_truth == "73"
    assert record.tools_kwargs == {"calculator": {}}


def test_numeric_ground_truth_becomes_a_string() -> None:
    assert validate_record({**GOOD, "ground_truth": 72}).ground_truth == "72"
    assert validate_record({**GOOD, "ground_truth": 72.0}).ground_truth == "72"
    assert validate_record({**GOOD, "ground_truth": 2.5}).ground_truth == "2.5"


def test_defaults_for_a_bare_prompt() -> None:
    record = validate_record(GOOD)
    assert record == Record(prompt=[{"role": "user", "content": "hi"}], data_source="unknown")


def test_unknown_top_level_keys_go_into_extra() -> None:
    record = validate_record({**GOOD, "ability": "math", "extra": {"difficulty": 2}})
    assert record.extra == {"ability": "math", "difficulty": 2}


def test_extra_message_keys_pass_through_and_parquet_nulls_are_dropped() -> None:
    call = [{"type": "function", "function": {"name": "calculator", "arguments": "{}"}}]
    prompt = [
        {"role": "user", "content": "2+2?", "tool_calls": None},
        {"role": "assistant", "content": "", "tool_calls": call},
    ]
    record = validate_record({"prompt": prompt})
    assert record.prompt == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": call},
    ]


def test_prompt_as_numpy_array_is_accepted() -> None:
    np = pytest.importorskip("numpy")
    prompt = np.array([{"role": "user", "content": "hi"}], dtype=object)
    assert validate_record({"prompt": prompt}).prompt == [{"role": "user", "content": "hi"}]


# --- errors for people ------------------------------------------------------------------------


def test_error_message_names_file_line_record_and_field(tmp_path: Path) -> None:
    bad = {"prompt": [{"role": "user", "content": 3}]}
    path = _write_jsonl(tmp_path / "x.jsonl", [GOOD] * 6 + [bad])
    with pytest.raises(RecordError) as caught:
        load_records(path)
    error = caught.value
    assert str(error) == f"{path} line 7 (record 6), field prompt[0].content: expected a string, got int"
    assert (error.path, error.line, error.index, error.field) == (str(path), 7, 6, "prompt[0].content")
    assert error.message == "expected a string, got int"
    assert isinstance(error, ValueError)


BAD_RECORDS = [
    pytest.param([1, 2], None, "expected a JSON object, got list", id="not_an_object"),
    pytest.param({"data_source": "x"}, "prompt", "missing", id="missing_prompt"),
    pytest.param({"prompt": []}, "prompt", "empty", id="empty_prompt"),
    pytest.param({"prompt": "hi"}, "prompt", "expected a list of chat messages, got string", id="prompt_not_a_list"),
    pytest.param(
        {"prompt": [GOOD["prompt"][0], "hi"]},
        "prompt[1]",
        "expected a message object",
        id="message_not_an_object",
    ),
    pytest.param({"prompt": [{"content": "hi"}]}, "prompt[0].role", "missing", id="missing_role"),
    pytest.param({"prompt": [{"role": "bot", "content": "hi"}]}, "prompt[0].role", "unknown role 'bot'", id="bad_role"),
    pytest.param({"prompt": [{"role": "user"}]}, "prompt[0].content", "missing", id="missing_content"),
    pytest.param(
        {"prompt": [{"role": "user", "content": ["hi"]}]},
        "prompt[0].content",
        "expected a string, got list",
        id="content_not_a_string",
    ),
    pytest.param(
        {**GOOD, "data_source": 5}, "data_source", "expected a string, got int", id="data_source_not_a_string"
    ),
    pytest.param(
        {**GOOD, "ground_truth": [1]},
        "ground_truth",
        "expected a string or a number, got list",
        id="ground_truth_list",
    ),
    pytest.param({**GOOD, "ground_truth": True}, "ground_truth", "got bool", id="ground_truth_bool"),
    pytest.param(
        {**GOOD, "tools_kwargs": ["calculator"]},
        "tools_kwargs",
        "expected a mapping",
        id="tools_kwargs_not_a_mapping",
    ),
    pytest.param(
        {**GOOD, "tools_kwargs": {"calculator": "x"}},
        "tools_kwargs.calculator",
        "expected a mapping",
        id="tool_entry_not_a_mapping",
    ),
    pytest.param(
        {**GOOD, "tools_kwargs": {"calculator": {"create_kwarg": {}}}},
        "tools_kwargs.calculator.create_kwarg",
        "unknown key; allowed keys are create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs",
        id="unknown_tools_kwargs_key",
    ),
    pytest.param(
        {**GOOD, "tools_kwargs": {"calculator": {"create_kwargs": [1]}}},
        "tools_kwargs.calculator.create_kwargs",
        "expected a mapping of keyword arguments, got list",
        id="kwargs_not_a_mapping",
    ),
    pytest.param(
        {**GOOD, "extra_info": {"tools_kwargs": {"calc": {"run_kwargs": {}}}}},
        "extra_info.tools_kwargs.calc.run_kwargs",
        "unknown key",
        id="verl_tools_kwargs_unknown_key",
    ),
    pytest.param(
        {**GOOD, "reward_model": "rule"},
        "reward_model",
        "expected a mapping",
        id="reward_model_not_a_mapping",
    ),
    pytest.param({**GOOD, "extra": [1]}, "extra", "expected a mapping, got list", id="extra_not_a_mapping"),
]


@pytest.mark.parametrize(("bad", "field", "message"), BAD_RECORDS)
def test_bad_record_error_names_file_line_record_and_field(
    tmp_path: Path, bad: Any, field: str | None, message: str
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", bad])
    with pytest.raises(RecordError) as caught:
        load_records(path)
    where = f"{path} line 3 (record 1)" + (f", field {field}" if field else "")
    assert str(caught.value).startswith(f"{where}: ")
    assert message in caught.value.message
    assert caught.value.field == field


def test_parquet_error_names_file_record_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    rows = [_gsm8k_verl_row(0, "q", "1"), _gsm8k_verl_row(1, "q", "2")]
    rows[1]["prompt"][0]["role"] = "robot"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(RecordError, match=r"bad\.parquet record 1, field prompt\[0\]\.role: unknown role 'robot'"):
        load_records(path)


def test_json_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "broken.jsonl", [GOOD, GOOD, '{"prompt": [}'])
    with pytest.raises(RecordError, match=r"broken\.jsonl line 3 \(record 2\): invalid JSON") as caught:
        load_records(path)
    assert caught.value.line == 3


def test_json_file_must_hold_a_list(tmp_path: Path) -> None:
    path = tmp_path / "one.json"
    path.write_bytes(orjson.dumps(GOOD))
    with pytest.raises(RecordError, match=r"one\.json: expected a JSON list of records, got object"):
        load_records(path)


def test_error_in_json_list_names_the_record(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_bytes(orjson.dumps([GOOD, {"prompt": []}]))
    with pytest.raises(RecordError, match=r"list\.json record 1, field prompt: empty"):
        load_records(path)


def test_missing_file_is_a_record_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(RecordError, match=r"nowhere\.jsonl: file not found") as caught:
        load_records(path)
    assert caught.value.path == str(path)


def test_unsupported_extension_is_a_record_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(
        RecordError, match=r"data\.csv: unsupported file type '\.csv'; use one of \.jsonl, \.json, \.parquet"
    ):
        load_records(path)


def test_validate_record_without_a_file_names_record_and_field() -> None:
    with pytest.raises(RecordError) as caught:
        validate_record({"prompt": [{"role": "user", "content": None}]}, index=4)
    assert str(caught.value) == "record 4, field prompt[0].content: missing; every message needs a string content"


# --- saving -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["out.jsonl", "out.json", "out.parquet"])
def test_save_leaves_no_temp_file(tmp_path: Path, name: str) -> None:
    save_records(_records(), tmp_path / name)
    assert [path.name for path in tmp_path.iterdir()] == [name]


def test_failed_save_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    save_records(_records(), path)
    before = path.read_bytes()
    unencodable = Record(prompt=_messages("q"), extra={"ids": {1, 2}})
    with pytest.raises(RecordError, match=r"out\.jsonl record 0: cannot be written as JSON"):
        save_records([unencodable], path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_parquet_save_of_records_parquet_cannot_hold_says_to_use_jsonl(tmp_path: Path) -> None:
    empty_kwargs = Record(prompt=_messages("q"), tools_kwargs={"calculator": {"create_kwargs": {}}})
    with pytest.raises(RecordError, match=r"out\.parquet: cannot store these records in parquet .* save as \.jsonl"):
        save_records([empty_kwargs], tmp_path / "out.parquet", layout="verl")


def test_save_creates_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "out.jsonl"
    save_records(_records(), path)
    assert load_records(path) == _records()
