"""Evaluation per data_source and its Markdown report: the breakdown, the report's tables and
failures, and `rallyrl eval --report`."""

from __future__ import annotations

import json

import pytest
from conftest import ScriptedEngine, run_cli

from data.schema import Record, save_records
from rollout.loop import RolloutConfig
from rollout.tokens import ChatTokenizer
from tools.registry import DEFAULT_TOOLS, build_tools
from trainer.evaluation import MAX_FAILURES_PER_SOURCE, evaluate, markdown_report, write_markdown_report


def _records(sources: list[str]) -> list[Record]:
    """Prompt i asks for i and comes from sources[i]."""
    return [
        Record(prompt=[{"role": "user", "content": f"q{i}"}], data_source=source, ground_truth=str(i))
        for i, source in enumerate(sources)
    ]


async def _evaluate(tokenizer, records: list[Record], right, samples: int = 2) -> dict:
    """``right(prompt_index, sample_index)`` says whether that sample answers correctly."""
    tools = build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(tokenizer, [t.schema for t in tools.values()])

    def script(turn: int, prompt: str, rid: str) -> str:
        prompt_index, sample = int(rid.split("-")[1]), int(rid.split("-")[2])
        return f"\\boxed{{{prompt_index if right(prompt_index, sample) else -1}}}"

    engine = ScriptedEngine(chat, script)
    return await evaluate(engine, chat, tools, records, RolloutConfig(), samples_per_prompt=samples, progress=False)


@pytest.fixture
async def two_source_report(tokenizer) -> dict:
    """alpha (prompts 0, 1) is always right; beta (prompts 2, 3) only on prompt 2's first sample."""
    records = _records(["alpha", "alpha", "beta", "beta"])
    return await _evaluate(tokenizer, records, lambda p, s: p < 2 or (p == 2 and s == 0))


async def test_evaluate_breaks_accuracy_and_pass_at_k_down_by_data_source(two_source_report):
    by_source = two_source_report["by_data_source"]
    assert set(by_source) == {"alpha", "beta"}
    assert by_source["alpha"] == {"prompts": 2, "accuracy": 1.0, "pass_at_k": {"1": 1.0, "2": 1.0}}
    assert by_source["beta"]["prompts"] == 2 and by_source["beta"]["accuracy"] == 0.5
    assert by_source["beta"]["pass_at_k"] == {"1": pytest.approx(0.25), "2": pytest.approx(0.5)}


async def test_overall_figures_keep_their_keys_and_values(two_source_report):
    assert {"prompts", "accuracy", "greedy", "pass_at_k", "sampled"} <= set(two_source_report)
    assert two_source_report["prompts"] == 4 and two_source_report["accuracy"] == 0.75
    assert two_source_report["pass_at_k"] == {"1": pytest.approx(0.625), "2": pytest.approx(0.75)}


async def test_report_keeps_the_greedy_failures_as_examples(two_source_report):
    (failure,) = two_source_report["failures"]
    assert failure["data_source"] == "beta" and failure["prompt_index"] == 3
    assert failure["question"] == "q3" and failure["ground_truth"] == "3" and failure["response"] == "\\boxed{-1}"


async def test_report_keeps_only_a_few_failures_per_data_source(tokenizer):
    report = await _evaluate(tokenizer, _records(["alpha"] * 6 + ["beta"]), lambda p, s: False, samples=1)
    sources = [f["data_source"] for f in report["failures"]]
    assert sources == ["alpha"] * MAX_FAILURES_PER_SOURCE + ["beta"]


async def test_a_source_without_ground_truth_has_no_accuracy(tokenizer):
    records = [*_records(["graded"]), Record(prompt=[{"role": "user", "content": "hi"}], data_source="chat")]
    report = await _evaluate(tokenizer, records, lambda p, s: True, samples=1)
    assert report["by_data_source"]["chat"] == {"prompts": 1, "accuracy": None, "pass_at_k": {"1": None}}
    assert "| chat | 1 | - | - |" in markdown_report(report)


async def test_markdown_report_has_overall_and_per_source_tables_and_failures(two_source_report):
    text = markdown_report(two_source_report, {"model": "tiny"})
    assert "- model: `tiny`" in text
    overall = text.split("## Overall")[1].split("##")[0]
    assert "| prompts | greedy accuracy | pass@1 | pass@2 |" in overall and "| 4 | 0.750 | 0.625 | 0.750 |" in overall
    by_source = text.split("## By data_source")[1].split("##")[0]
    assert "| alpha | 2 | 1.000 | 1.000 | 1.000 |" in by_source
    assert "| beta | 2 | 0.500 | 0.250 | 0.500 |" in by_source
    failures = text.split("## Example failures")[1]
    assert "### 1. beta, prompt 3" in failures and "```text\nq3\n```" in failures
    assert "```text\n\\boxed{-1}\n```" in failures and "- ground truth: `3`" in failures


def test_markdown_report_escapes_pipes_and_outfences_backticks():
    report = {
        "prompts": 1, "accuracy": 0.0, "pass_at_k": {"1": 0.0},
        "by_data_source": {"a|b": {"prompts": 1, "accuracy": 0.0, "pass_at_k": {"1": 0.0}}},
        "failures": [{"data_source": "a|b", "prompt_index": 0, "question": "x", "ground_truth": "1",
                      "response": "```\nnot the end\n```", "finish_reason": "stop", "error": None,
                      "turns": 1, "tool_calls": 0}],
    }  # fmt: skip
    text = markdown_report(report)
    assert "| a\\|b | 1 | 0.000 | 0.000 |" in text
    assert "````text\n```\nnot the end\n```\n````" in text


def test_write_markdown_report_replaces_the_file_whole(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("old")
    report = {"prompts": 0, "accuracy": None, "pass_at_k": {}, "by_data_source": {}, "failures": []}
    write_markdown_report(report, path)
    assert path.read_text() == markdown_report(report)
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.slow
def test_eval_command_writes_a_markdown_report_and_prints_the_breakdown(tmp_path, tiny_model_dir):
    data = tmp_path / "two.jsonl"
    save_records(_records(["alpha", "beta", "beta"]), data)
    report, json_out = tmp_path / "out" / "eval.md", tmp_path / "eval.json"
    done = run_cli(
        "eval", "--model", str(tiny_model_dir), "--data", str(data), "-n", "1", "--max-new-tokens", "4",
        "--json", str(json_out), "--report", str(report), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "evaluation by data_source" in done.stderr and "alpha" in done.stderr and "beta" in done.stderr
    data_json = json.loads(json_out.read_text())
    assert data_json["prompts"] == 3 and set(data_json["pass_at_k"]) == {"1"}
    assert {s: v["prompts"] for s, v in data_json["by_data_source"].items()} == {"alpha": 1, "beta": 2}
    text = report.read_text()
    assert "| alpha | 1 | 0.000 | 0.000 |" in text and "| beta | 2 | 0.000 | 0.000 |" in text
    assert "## Example failures" in text and "### 1. alpha, prompt 0" in text
    assert sorted(p.name for p in report.parent.iterdir()) == ["eval.md"]
