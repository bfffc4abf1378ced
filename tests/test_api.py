"""The Python entry points the CLI calls, used directly as the README shows."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from rollout.api import SetupError, load_prompts, resolve_model, rollout
from rollout.config import RolloutConfig, RolloutJobConfig
from trainer.config import EvalConfig
from trainer.evaluation import run_eval


def test_rollout_entry_point_writes_every_trajectory(tmp_path, tiny_model_dir):
    out = tmp_path / "out.jsonl"
    job = RolloutJobConfig(model=str(tiny_model_dir), num_prompts=3, samples_per_prompt=2, out=str(out),
                           progress=False, rollout=RolloutConfig(max_turns=2, max_new_tokens=16))  # fmt: skip
    result = asyncio.run(rollout(job))
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(result.requests) == len(lines) == 6
    assert sorted((r["prompt_index"], r["sample_index"]) for r in lines) == [(p, s) for p in range(3) for s in range(2)]
    assert result.summary.trajectories == 6 and result.summary.samples_per_prompt == 2
    assert all(sum(r["loss_mask"]) <= 2 * 16 for r in lines)


def test_eval_entry_point_reports_accuracy_on_its_preset(tiny_model_dir):
    config = EvalConfig(model=str(tiny_model_dir), num_prompts=2, samples_per_prompt=2, progress=False)
    report = asyncio.run(run_eval(config))
    assert report["prompts"] == 2 and set(report["pass_at_k"]) == {"1", "2"}


def test_prompts_come_from_the_task_with_the_commands_own_count():
    assert len(load_prompts(RolloutJobConfig())) == 64
    assert len(load_prompts(EvalConfig(), EvalConfig().prompts_wanted)) == 300
    with pytest.raises(SetupError, match="task: unknown synthetic task 'nope'"):
        load_prompts(RolloutJobConfig(task="nope"))


def test_model_directory_errors_say_what_to_give(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(SetupError, match="a training run directory; give its final/ or checkpoints/step-N/"):
        resolve_model(tmp_path / "run")
    with pytest.raises(SetupError, match="no such directory"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(SetupError, match=r"not a Hugging Face model directory \(no config.json\)"):
        resolve_model(tmp_path)
    assert (resolve_model(None) / "config.json").is_file()  # the embedded model
