"""Evaluation: unbiased pass@k, greedy accuracy, and the train / sft / eval commands end to end."""

from __future__ import annotations

import json

import pytest
from conftest import ScriptedEngine, run_cli

from data.schema import Record
from rollout.loop import RolloutConfig
from rollout.tokens import ChatTokenizer
from tools.registry import DEFAULT_TOOLS, build_tools
from trainer.evaluation import evaluate, pass_at_k


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [(4, 0, 1, 0.0), (4, 4, 2, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (5, 2, 2, 1 - 3 / 10), (3, 1, 3, 1.0)],
)
def test_pass_at_k_is_the_unbiased_estimator(n, correct, k, expected):
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError, match="needs at least 3 samples"):
        pass_at_k(2, 1, 3)


async def test_evaluate_reports_greedy_accuracy_and_pass_at_k(tokenizer):
    tools = build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(tokenizer, [t.schema for t in tools.values()])
    records = [Record(prompt=[{"role": "user", "content": f"q{i}"}], ground_truth=str(i)) for i in range(4)]

    def script(turn: int, prompt: str, rid: str) -> str:
        """Right on even prompts, first sample only: greedy (one sample) scores 1/2; sampling 1 in 4."""
        prompt_index, sample = int(rid.split("-")[1]), int(rid.split("-")[2])
        right = prompt_index % 2 == 0 and sample == 0
        return f"\\boxed{{{prompt_index if right else -1}}}"

    engine = ScriptedEngine(chat, script)
    report = await evaluate(engine, chat, tools, records, RolloutConfig(), samples_per_prompt=4, progress=False)
    assert report["accuracy"] == 0.5
    assert report["pass_at_k"] == {"1": pytest.approx(0.125), "2": pytest.approx(0.25), "4": pytest.approx(0.5)}


@pytest.mark.slow
def test_eval_command_writes_accuracy_and_pass_at_k_json(tmp_path, tiny_model_dir):
    report = tmp_path / "eval.json"
    done = run_cli(
        "eval", "--model", str(tiny_model_dir), "--num-prompts", "3", "-n", "2", "--max-new-tokens", "8",
        "--json", str(report), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert data["prompts"] == 3 and data["accuracy"] == 0.0
    assert set(data["pass_at_k"]) == {"1", "2"}


@pytest.mark.slow
def test_train_command_runs_and_resumes(tmp_path, tiny_model_dir):
    common = ["train", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"),
              "--prompts-per-step", "2", "-n", "2"]  # fmt: skip
    first = run_cli(*common, "--steps", "1")
    assert first.returncode == 0, first.stderr
    again = run_cli(*common, "--steps", "2", "--resume")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_train_command_rejects_a_bad_config_file(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("stepz: 3\n")
    done = run_cli("train", "--config", str(path))
    assert done.returncode == 2 and "stepz: unknown field; did you mean 'steps'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_sft_command_trains_and_checkpoints(tmp_path, tiny_model_dir):
    out = tmp_path / "sft"
    done = run_cli(
        "sft", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--batch-size", "2",
        "--num-examples", "8", "--eval-every", "2", "--eval-prompts", "0", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (out / "step-2" / "config.json").is_file() and (out / "sft_log.jsonl").is_file()
