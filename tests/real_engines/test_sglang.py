"""rallyrl against a real SGLang 0.5.23 on this CPU (``.ci/install_engines sglang``): the CLI
rollout, token ids and logprobs against the embedded model's own forward pass, GRPO training
that broadcasts its weights into the server every step (and a LoRA run's merged fallback: SGLang's CPU
path cannot load adapters), a weight update from disk in the middle of a rollout (pause,
abort, resume from the tokens so far), and the in-process ``sglang.Engine`` adapter for rollout and
training. Two servers (behind sglang-router and our pool, training into both, a restart):
``test_sglang_pair.py``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import orjson
import torch
from transformers import AutoModelForCausalLM

from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.api import resolve_model
from rollout.engines.base import SamplingParams
from rollout.engines.local import LocalEngine
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.loop import RolloutConfig
from tests.conftest import run_cli
from tests.real_engines.conftest import reference_logprobs, require_engine
from tests.test_serve_processes import (
    assert_all_accounted,
    assert_resumed_across_the_update,
    calc_runner,
    get_json,
    read_jsonl,
    save_perturbed_model,
)

SAMPLED = RolloutConfig(max_turns=3, max_new_tokens=96, max_model_len=1024, temperature=1.0, seed=11)
GREEDY = RolloutConfig(max_turns=3, max_new_tokens=96, max_model_len=1024, temperature=0.0)


def max_logprob_gap(model, requests) -> float:
    """Largest |engine logprob - forward-pass logprob| over every generated token of ``requests``."""
    gap = 0.0
    for request in requests:
        ids = request.prompt_ids + request.response_ids
        expected = reference_logprobs(model, ids, len(request.prompt_ids))
        for i, (mask, logprob) in enumerate(zip(request.loss_mask, request.logprobs, strict=True)):
            if mask:
                gap = max(gap, abs(logprob - float(expected[i])))
    return gap


def test_cli_rollout_on_real_sglang_writes_valid_trajectories(sglang_url, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    made = run_cli("rollout", "--num-prompts", "16", "-n", "2", "--engine-url", sglang_url, "--out", str(out),
                   "--no-progress")  # fmt: skip
    assert made.returncode == 0, made.stderr
    lines = read_jsonl(out)
    assert len(lines) == 32
    assert {line["finish_reason"] for line in lines} <= {"stop", "length"}, [line.get("error") for line in lines]
    assert sum(line["reward"] for line in lines) > 0  # the model solves some
    assert run_cli("check", str(out)).returncode == 0


async def test_token_ids_and_logprobs_agree_with_the_embedded_forward_pass(sglang_url, tmp_path, embedded_model):
    model = embedded_model
    async with SGLangHTTPEngine(sglang_url) as engine:
        sampled = await calc_runner(engine, config=SAMPLED).run(make_task("calc", 12, seed=21), 1, tmp_path / "s.jsonl")
        greedy = await calc_runner(engine, config=GREEDY).run(make_task("calc", 12, seed=22), 1, tmp_path / "g.jsonl")
    for result in (sampled, greedy):
        assert all(r.finish_reason.value in ("stop", "length") for r in result.requests)
        assert result.summary.consistency_failures == 0
    # Hundreds of sampled tokens to compare. How many varies from run to run: SGLang's CPU batches the 12 requests
    # as they arrive, and a sampled token can differ with the batch (455 and over 500 both seen).
    assert sum(len(r.response_ids) for r in sampled.requests) > 200
    assert max_logprob_gap(model, sampled.requests) < 1e-4
    assert max_logprob_gap(model, greedy.requests) < 1e-4
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL) as local:  # greedy: the same tokens as ours
        ours = await calc_runner(local, config=GREEDY).run(make_task("calc", 12, seed=22), 1, tmp_path / "o.jsonl")

    def by_prompt(result) -> dict[str, list[int]]:  # request ids are "<run>-<prompt>-<sample>"
        return {r.request_id.split("-", 1)[1]: r.response_ids for r in result.requests}

    assert by_prompt(ours) == by_prompt(greedy)


FIXED_IDS = [1, 90, 93, 79, 92, 8, 20, 13, 23, 2, 8, 1, 75, 93, 93, 83, 93, 94, 75, 88, 94, 8]


def served_logprobs(url: str, ids: list[int]) -> torch.Tensor:
    """The server's logprobs of ``ids[1:]`` (teacher-forced)."""
    body = orjson.loads(run_curl(url, {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0,
    }))  # fmt: skip
    return torch.tensor([entry[0] for entry in body["meta_info"]["input_token_logprobs"][1:]])


def test_train_broadcasts_weights_into_real_sglang_every_step_and_writes_none(sglang_scratch_url, tmp_path,
                                                                               embedded_model):  # fmt: skip
    out = tmp_path / "run"
    trained = run_cli("train", "--steps", "3", "--prompts-per-step", "4", "-n", "4", "--out", str(out),
                      "--engine-url", sglang_scratch_url, "--no-progress", "--set", "weight_sync.check_logprobs=true",
                      timeout=900)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    said = [line for line in trained.stderr.splitlines() if line.startswith("weight sync: ")]
    assert said == [f"weight sync: broadcast (gloo) into {sglang_scratch_url} (SGLang 0.5.23, cpu, float32)"]
    info = get_json(f"{sglang_scratch_url}/get_model_info")
    served = served_logprobs(sglang_scratch_url, FIXED_IDS)
    assert info["weight_version"] == "3"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2]  # the versions each step rolled out on
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3]  # and the server reported after each sync
    assert all(m["rollout/staleness_max"] == 0 for m in metrics)
    # after each step the server's logprobs of a fixed prompt are the trainer's forward pass
    assert all(m["sync/logprob_gap"] < 1e-5 for m in metrics), [m["sync/logprob_gap"] for m in metrics]
    assert not (out / "weights").exists()  # nothing went through disk
    final = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True, dtype=torch.float32)
    expected = reference_logprobs(final.eval(), FIXED_IDS)
    assert torch.allclose(served, expected, atol=1e-5)
    original = reference_logprobs(embedded_model, FIXED_IDS)
    assert not torch.allclose(original, expected, atol=1e-4)  # training changed the policy


def test_lora_on_sglangs_cpu_path_falls_back_to_merged_weights_and_says_why(sglang_scratch_url, tmp_path):
    """SGLang 0.5.23 cannot start with --enable-lora on CPU (its LoRA layers pin memory: "Found no
    NVIDIA driver"), so a LoRA run syncs the adapter merged into full weights, as documented."""
    out = tmp_path / "run"
    trained = run_cli("train", "--steps", "2", "--prompts-per-step", "4", "-n", "4", "--out", str(out),
                      "--engine-url", sglang_scratch_url, "--no-progress", "--set", "lora.rank=8", "--lr", "1e-2",
                      timeout=900)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    said = [line for line in trained.stderr.splitlines() if line.startswith("lora: ")]
    assert len(said) == 1 and "merged into full weights" in said[0] and "Found no NVIDIA driver" in said[0], said
    assert [m["rollout/weight_version"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    assert get_json(f"{sglang_scratch_url}/get_model_info")["weight_version"] == "2"
    served = served_logprobs(sglang_scratch_url, FIXED_IDS)
    adapted = AutoModelForCausalLM.from_pretrained(resolve_model(out / "final"), dtype=torch.float32).eval()
    assert torch.allclose(served, reference_logprobs(adapted, FIXED_IDS), atol=1e-4)
    strict = run_cli("train", "--steps", "1", "--out", str(tmp_path / "strict"), "--engine-url", sglang_scratch_url,
                     "--no-progress", "--set", "lora.rank=8", "--set", "lora.sync=adapter")  # fmt: skip
    assert strict.returncode != 0 and "lora.sync adapter" in strict.stderr and "set lora.sync: merged" in strict.stderr
    assert not (tmp_path / "strict" / "metrics.jsonl").exists()


def run_curl(url: str, payload: dict) -> bytes:
    """POST ``payload`` to ``url/generate`` (urllib, no event loop)."""
    import urllib.request

    request = urllib.request.Request(f"{url}/generate", orjson.dumps(payload), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


async def test_weight_update_mid_rollout_resumes_each_generation_on_the_new_weights(sglang_scratch_url, tmp_path):
    new_weights = save_perturbed_model(EMBEDDED_MODEL, tmp_path / "v1")
    config = RolloutConfig(max_turns=1, max_new_tokens=400, max_model_len=2048, temperature=1.0,
                           check_consistency=False)  # fmt: skip
    looping = [1, 93, 99, 93]  # greedy, the embedded model repeats "c" for hundreds of tokens from here
    async with SGLangHTTPEngine(sglang_scratch_url) as engine:
        # an explicit pause holds new requests until generation continues
        await engine.pause_generation()
        held = asyncio.create_task(engine.generate([1, 75], SamplingParams(max_new_tokens=4), "held"))
        await asyncio.sleep(1.0)
        assert not held.done()
        await engine.continue_generation()
        assert (await asyncio.wait_for(held, 60)).finish_reason in ("stop", "length")
        # abort of one request by its id ends it with "abort" (not resumed)
        greedy = SamplingParams(max_new_tokens=1500, temperature=0.0)
        aborted = asyncio.create_task(engine.generate(looping, greedy, "victim"))
        await asyncio.sleep(1.0)
        await engine.abort("victim")
        victim = await asyncio.wait_for(aborted, 60)
        assert victim.finish_reason == "abort" and 0 < len(victim.output_ids) < 1500
        # a weight update in the middle of a rollout: pause (abort) -> load -> continue, each
        # aborted generation resumed from its tokens so far on the new weights
        rollout = asyncio.create_task(
            calc_runner(engine, max_concurrency=32, config=config).run(
                make_task("calc", 16, seed=6), 2, tmp_path / "out.jsonl"
            )
        )
        while engine.in_flight < 16:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # generations under way
        assert not rollout.done()
        await engine.sync_weights_from_disk(str(new_weights), 1)
        result = await rollout
        server_version = await engine.get_weight_version()
    assert_all_accounted(result, tmp_path / "out.jsonl", 32)
    assert server_version == 1
    assert_resumed_across_the_update(result)


# ----- the in-process sglang.Engine (rollout/engines/sglang_engine.py) -------------------------------

IN_PROCESS = """\
engine:
  kind: sglang
  sglang:
    server_args: {device: cpu, dtype: float32, attention_backend: torch_native, context_length: 2048,
                  max_total_tokens: 65536, sleep_on_idle: true, log_level: warning}
"""


def run_in_sglang_venv(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """``rallyrl ARGS`` run by SGLang's virtualenv (where ``sglang.Engine`` imports), on the CPU."""
    python = require_engine("sglang")
    venv = python.parent.parent
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "LD_LIBRARY_PATH": str(venv / "cuda-stub"),
           "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": f"file://{cwd}/dist-init-{time.monotonic_ns()}"}  # fmt: skip
    return subprocess.run([str(venv / "bin" / "rallyrl"), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)  # fmt: skip


def test_in_process_sglang_engine_rolls_out(tmp_path):
    config = tmp_path / "sglang.yaml"
    config.write_text(IN_PROCESS)
    out = tmp_path / "rollouts.jsonl"
    rolled = run_in_sglang_venv("rollout", "--config", str(config), "--num-prompts", "8", "-n", "2", "--out",
                                str(out), "--no-progress", cwd=tmp_path)  # fmt: skip
    assert rolled.returncode == 0, rolled.stderr[-4000:]
    lines = read_jsonl(out)
    assert len(lines) == 16 and all(line["finish_reason"] in ("stop", "length") for line in lines)
    assert run_cli("check", str(out)).returncode == 0


def test_async_training_on_the_in_process_sglang_engine_resumes_requests_across_updates(tmp_path):
    # One training run covers the in-process engine's weight updates: a step-by-step run pushes its
    # weights through the same engine call, without requests in flight (one engine start fewer: ~2 min).
    config = tmp_path / "sglang.yaml"
    config.write_text(IN_PROCESS)
    run = tmp_path / "run"
    trained = run_in_sglang_venv("train", "--config", str(config), "--steps", "3", "--prompts-per-step", "4",
                                 "-n", "4", "--async", "--max-staleness", "1", "--out", str(run), "--no-progress",
                                 cwd=tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-4000:]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["rollout/weight_version"] >= 1  # the engine rolled out on updated weights
    assert (run / "final" / "config.json").is_file()
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics)
    # requests aborted by the updates were resumed on the new weights, none failed
    assert all(m["rollout/error_rate"] == 0 and m["rollout/generated_tokens"] > 0 for m in metrics)
