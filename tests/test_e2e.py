"""End to end on real pieces: a tiny Qwen2 through the local engine, and the installed CLI."""

from __future__ import annotations

import orjson
import pytest
import torch
from conftest import run_cli

from data.synthetic import make_calc_records
from rollout.engines.local import LocalEngine
from rollout.loop import RolloutConfig
from rollout.request import validate_trajectory
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.registry import DEFAULT_TOOLS, build_tools


async def test_tiny_model_rollout_keeps_tokens_masks_and_logprobs_exact(tiny_model_dir, tmp_path):
    tools = build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(load_tokenizer(tiny_model_dir), [t.schema for t in tools.values()])
    config = RolloutConfig(max_new_tokens=24, max_turns=3)
    async with LocalEngine.from_pretrained(tiny_model_dir) as engine:
        runner = RolloutRunner(engine, chat, tools, config, max_concurrency=8, progress=False)
        result = await runner.run(make_calc_records(6, seed=1), samples_per_prompt=2, out_path=tmp_path / "out.jsonl")
        model = engine.model

    assert len(result.requests) == 12
    assert result.summary.consistency_failures == 0
    for line in (tmp_path / "out.jsonl").read_bytes().splitlines():
        validate_trajectory(orjson.loads(line))
    for request in result.requests[:4]:  # the engine's logprobs are the policy's, token for token
        ids = request.all_ids
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        start = len(request.prompt_ids)
        for i, (token, mask, logprob) in enumerate(
            zip(request.response_ids, request.loss_mask, request.logprobs, strict=True)
        ):
            if mask:
                assert logprob == pytest.approx(logprobs[start + i - 1, token].item(), abs=1e-3)


@pytest.mark.slow
def test_cli_rollout_writes_valid_trajectories(tmp_path):
    model_dir, out = tmp_path / "model", tmp_path / "out.jsonl"
    made = run_cli("new-model", str(model_dir), "--hidden-size", "32", "--layers", "1")
    assert made.returncode == 0, made.stderr
    done = run_cli(
        "rollout", "--model", str(model_dir), "--task", "calc", "--num-prompts", "4", "-n", "2",
        "--out", str(out), "--max-new-tokens", "16", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rollout summary" in done.stderr
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert sorted((r["prompt_index"], r["sample_index"]) for r in lines) == [(p, s) for p in range(4) for s in range(2)]
    checked = run_cli("check", str(out))
    assert checked.returncode == 0 and "8 valid trajectories" in checked.stderr


def test_cli_bad_dataset_record_exits_2_naming_file_line_and_field(tmp_path, tiny_model_dir):
    data, out = tmp_path / "bad.jsonl", tmp_path / "out.jsonl"
    data.write_text(
        '{"prompt": [{"role": "user", "content": "hi"}]}\n{"prompt": [{"role": "robot", "content": "x"}]}\n'
    )
    done = run_cli("rollout", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out))
    assert done.returncode == 2
    assert str(data) in done.stderr and "line 2" in done.stderr and "prompt[0].role" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "nope"], "unknown synthetic task 'nope'"),
        (["--model", "/nonexistent"], "model /nonexistent: no such directory"),
        (["--tools", "/nonexistent/tools.yaml"], "cannot read tool config"),
        (["--task", "calc", "--data", "x.jsonl"], "give task or data, not both"),
    ],
)
def test_cli_bad_options_exit_2_with_a_message(tmp_path, tiny_model_dir, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    done = run_cli("rollout", *args, "--out", str(tmp_path / "out.jsonl"))
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_cli_check_reports_the_broken_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"request_id": "x"}\n')
    done = run_cli("check", str(path))
    assert done.returncode == 2 and "line 1: missing field(s)" in done.stderr
