"""Trajectory exports and inspection: JSONL -> parquet round trips, bad input is named and writes
nothing, and `rallyrl show` prints one trajectory's header, turns, tool calls and token spans."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from rollout.files.export import ExportError, export_parquet, iter_parquet_trajectories, read_parquet_trajectory
from rollout.files.show import ShowError, load_trajectory
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState, Rewards, ToolCallRecord

TYPED_FIELDS = ("request_id", "prompt_index", "sample_index", "state", "finish_reason", "error", "data_source",
                "ground_truth", "prompt_ids", "response_ids", "loss_mask", "logprobs", "weight_versions", "reward",
                "turns", "trace")  # fmt: skip
JSON_FIELDS = ("messages", "rewards", "tool_calls", "metrics")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """rich lays out for 200 columns in the subprocesses, so no field is wrapped mid-word."""
    monkeypatch.setenv("COLUMNS", "200")


def _hand_made(tokenizer, request_id: str = "hand-3-1", answer: str = "42") -> dict:
    """A finished two-turn request: one tool call that works and one that fails, then an answer."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    request = AsyncRolloutRequest(
        request_id=request_id, prompt_index=3, sample_index=1, data_source="arith", ground_truth="42",
        messages=[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is [red]6*7[/red]?"}],
    )  # fmt: skip
    request.prompt_ids = encode("Use tools. What is 6*7?")
    request.transition(RequestState.RUNNING)
    call = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
    request.append_generated(encode(call), [-0.5] * len(encode(call)), 7)
    request.messages.append({"role": "assistant", "content": call})
    request.transition(RequestState.TOOL_CALLING)
    request.tool_calls += [
        ToolCallRecord(1, "echo", {"text": "hi"}, "hi", latency_s=0.012, reward=0.5),
        ToolCallRecord(1, "broken", None, "Error: no tool named broken", error="no tool named broken"),
    ]
    request.messages += [{"role": "tool", "content": "hi"}, {"role": "tool", "content": "Error: no tool named broken"}]
    request.append_context(encode("<tool_response>hi</tool_response>"))
    request.transition(RequestState.RUNNING)
    final = f"\\boxed{{{answer}}}"
    request.append_generated(encode(final), [-0.25] * len(encode(final)), 8)
    request.messages.append({"role": "assistant", "content": final})
    request.metrics.turns, request.metrics.tool_calls, request.metrics.tool_errors = 2, 2, 1
    request.finish(FinishReason.STOP)
    request.transition(RequestState.COMPLETED)
    right = float(answer == "42")
    request.rewards = Rewards(step=[0.5, 0.0], tools={"echo": 0.25}, answer=right, final=right)
    return request.to_record()


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


@pytest.fixture(scope="module")
def rollout_jsonl(tmp_path_factory) -> Path:
    """Two trajectories of the embedded model, as `rallyrl rollout` writes them."""
    out = tmp_path_factory.mktemp("rollout") / "rollouts.jsonl"
    done = run_cli("rollout", "--num-prompts", "2", "--max-new-tokens", "32", "--no-progress", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def hand_jsonl(tmp_path, tokenizer) -> Path:
    return _write_jsonl(tmp_path / "hand.jsonl", [_hand_made(tokenizer), _hand_made(tokenizer, "hand-4-0", "41")])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_export_round_trips_every_field(rollout_jsonl, tmp_path, tokenizer):
    source = _write_jsonl(tmp_path / "all.jsonl", [*_lines(rollout_jsonl), _hand_made(tokenizer)])
    out = tmp_path / "all.parquet"
    assert export_parquet(source, out, batch_size=2) == 3
    records = _lines(source)
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        assert {f: row[f] for f in TYPED_FIELDS} == {f: record[f] for f in TYPED_FIELDS}
        assert {f: json.loads(row[f]) for f in JSON_FIELDS} == {f: record[f] for f in JSON_FIELDS}
    assert list(iter_parquet_trajectories(out)) == records


def test_export_writes_one_row_group_per_batch_and_reads_any_row_back(hand_jsonl, tmp_path):
    out = tmp_path / "hand.parquet"
    export_parquet(hand_jsonl, out, batch_size=1)
    assert pq.ParquetFile(out).num_row_groups == 2
    assert read_parquet_trajectory(out, 1) == _lines(hand_jsonl)[1]


def test_export_keeps_unknown_top_level_keys(tmp_path, tokenizer):
    record = {**_hand_made(tokenizer), "judge_notes": {"why": "x"}, "extra": [1]}
    out = tmp_path / "x.parquet"
    export_parquet(_write_jsonl(tmp_path / "x.jsonl", [record]), out)
    assert json.loads(pq.read_table(out).to_pylist()[0]["extra"]) == {"judge_notes": {"why": "x"}, "extra": [1]}
    assert next(iter_parquet_trajectories(out)) == record


def test_export_command_writes_the_parquet_next_to_the_jsonl(hand_jsonl):
    done = run_cli("export", str(hand_jsonl))
    assert done.returncode == 0, done.stderr
    assert "wrote 2 trajectories" in done.stderr
    assert pq.read_table(hand_jsonl.with_suffix(".parquet")).num_rows == 2


def test_export_command_names_a_bad_line_and_writes_nothing(hand_jsonl, tmp_path):
    hand_jsonl.write_bytes(hand_jsonl.read_bytes() + b"{not json\n")
    out = tmp_path / "out.parquet"
    out.write_bytes(b"before")
    done = run_cli("export", str(hand_jsonl), "--out", str(out), "--batch-size", "1")
    assert done.returncode == 2
    assert f"{hand_jsonl} line 3: not JSON" in done.stderr and "Traceback" not in done.stderr
    assert out.read_bytes() == b"before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hand.jsonl", "out.parquet"]


def test_export_names_a_line_that_is_not_a_trajectory(tmp_path, tokenizer):
    record = _hand_made(tokenizer)
    del record["loss_mask"]
    source = _write_jsonl(tmp_path / "bad.jsonl", [_hand_made(tokenizer), record])
    with pytest.raises(ExportError, match=r"bad\.jsonl line 2: not a trajectory: missing field\(s\): loss_mask"):
        export_parquet(source, tmp_path / "bad.parquet")
    assert not (tmp_path / "bad.parquet").exists()


def test_export_names_a_token_id_that_does_not_fit_the_schema(tmp_path, tokenizer):
    record = _hand_made(tokenizer)
    record["prompt_ids"][0] = 2**40
    source = _write_jsonl(tmp_path / "big.jsonl", [_hand_made(tokenizer), record])
    with pytest.raises(ExportError, match=r"big\.jsonl line 2: does not fit the parquet schema"):
        export_parquet(source, tmp_path / "big.parquet", batch_size=8)


def test_export_says_when_the_last_line_was_cut_short(tmp_path, tokenizer):
    source = tmp_path / "torn.jsonl"
    source.write_bytes(orjson.dumps(_hand_made(tokenizer)) + b"\n" + orjson.dumps(_hand_made(tokenizer))[:40])
    with pytest.raises(ExportError, match=r"torn\.jsonl line 2: not JSON .*cut short"):
        export_parquet(source, tmp_path / "torn.parquet")


def _span_lengths(record: dict) -> list[int]:
    """Lengths of the runs of equal loss_mask values."""
    lengths, mask = [], record["loss_mask"]
    for i, value in enumerate(mask):
        if i and value == mask[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def test_show_prints_the_header_turns_tool_calls_and_token_spans(hand_jsonl):
    done = run_cli("show", str(hand_jsonl))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "trajectory 0 of 2" in out and "--index 0..1" in out
    for part in ("hand-3-1", "prompt_index 3, sample_index 1", "arith", "finish_reason", "stop",
                 "answer 1; step 0.5, 0; tools echo 0.25", "7 (", "8 ("):  # fmt: skip
        assert part in out, part
    assert "What is [red]6*7[/red]?" in out  # message text is text, not rich markup
    assert "assistant, turn 1" in out and "assistant, turn 2" in out
    assert "tool calls of turn 1" in out and '{"text":"hi"}' in out and "no tool named broken" in out
    assert "tool result: echo" in out and "latency 12.0 ms" in out and "tool result: broken" in out
    assert "1 trained" in out and "0 context" in out
    first, context, last = _span_lengths(_lines(hand_jsonl)[0])
    assert f"span 1, trained, {first} tokens: ids" in out and f"span 2, context, {context} tokens: ids" in out
    assert f"span 3, trained, {last} tokens: ids" in out


def test_show_decodes_the_spans_with_a_tokenizer_and_reads_the_parquet_export(hand_jsonl, tmp_path, tiny_model_dir):
    out = tmp_path / "hand.parquet"
    export_parquet(hand_jsonl, out)
    done = run_cli("show", str(out), "--index", "1", "--model", str(tiny_model_dir))
    assert done.returncode == 0, done.stderr
    assert "trajectory 1 of 2" in done.stdout and "hand-4-0" in done.stdout
    _, context, last = _span_lengths(_lines(hand_jsonl)[1])
    assert f"span 3, trained, {last} tokens: \\boxed{{41}}" in done.stdout
    assert f"span 2, context, {context} tokens: <tool_response>hi</tool_response>" in done.stdout


def test_show_escapes_control_bytes_that_the_file_keeps(tmp_path, tokenizer):
    record = _hand_made(tokenizer)
    record["messages"][3]["content"] = "a\x00b\x1b[2J\x1b]0;title\x07c\u202ed"  # a program's raw output
    path = _write_jsonl(tmp_path / "raw.jsonl", [record])
    done = run_cli("show", str(path))
    assert done.returncode == 0, done.stderr
    assert not any(char in done.stdout for char in "\x00\x1b\x07\u202e")
    assert "a\\x00b\\x1b[2J\\x1b]0;title\\x07c\\u202ed" in done.stdout
    assert _lines(path)[0]["messages"][3]["content"].startswith("a\x00b\x1b")  # the trajectory keeps them


def test_show_a_rollout_of_the_embedded_model(rollout_jsonl):
    done = run_cli("show", str(rollout_jsonl), "--index", "1")
    assert done.returncode == 0, done.stderr
    record = _lines(rollout_jsonl)[1]
    assert "trajectory 1 of 2" in done.stdout and record["request_id"] in done.stdout
    assert f"prompt {len(record['prompt_ids'])}, response {len(record['response_ids'])}" in done.stdout


def test_show_index_out_of_range_is_an_error(hand_jsonl):
    done = run_cli("show", str(hand_jsonl), "--index", "2")
    assert done.returncode == 2
    assert "--index 2 is out of range" in done.stderr and "holds 2 trajectories (0..1)" in done.stderr
    assert "Traceback" not in done.stderr


def test_show_names_a_bad_line(tmp_path, tokenizer):
    source = _write_jsonl(tmp_path / "bad.jsonl", [_hand_made(tokenizer), {"request_id": "x"}])
    with pytest.raises(ShowError, match=r"bad\.jsonl line 2: not a trajectory: missing field"):
        load_trajectory(source, 1)
    assert load_trajectory(source, 0).record["request_id"] == "hand-3-1"
