"""Weights in memory into real ``rallyrl serve`` processes on loopback: a training run that broadcasts
its weights every step and writes none to disk, a pool of two taking a broadcast and tensors, a server
killed and restarted brought back to the current version, a server that stops answering mid-update
taken out and never serving its half-loaded weights, and a model of another shape refused before the
first step. The same against real SGLang and vLLM: ``tests/real_engines/test_sglang_pair.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.config import WeightSyncConfig
from rollout.engines.pool import EnginePool, PoolConfig
from rollout.serve.processes import serve_processes, start_serve, wait_healthy
from rollout.tokens import load_tokenizer
from tests.conftest import run_cli, step_weights
from tests.test_serve_processes import get_json, read_jsonl
from trainer.weight_check import logprob_gap
from trainer.weight_source import PolicyWeights

FAST = PoolConfig(health_interval_s=0.3, failures_to_eject=2)




def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, orjson.dumps(body), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, orjson.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, orjson.loads(error.read())


@pytest.fixture
def trainer_weights(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    return model, PolicyWeights.of_model(model, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")


@pytest.mark.slow
def test_training_broadcasts_its_weights_into_the_server_every_step_and_writes_none(tmp_path):
    out = tmp_path / "run"
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        done = run_cli("train", "--engine-url", server.url, "--steps", "3", "--prompts-per-step", "2", "-n", "4",
                       "--out", str(out), "--no-progress", "--set", "weight_sync.check_logprobs=true",
                       timeout=600)  # fmt: skip
        served = get_json(f"{server.url}/get_model_info")["weight_version"]
        tensor = run_cli("train", "--engine-url", server.url, "--steps", "1", "--prompts-per-step", "2", "-n", "2",
                         "--out", str(tmp_path / "tensor"), "--no-progress", "--weight-sync", "tensor",
                         "--set", "weight_sync.check_logprobs=true", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("weight sync: ")]
    assert said == [f"weight sync: broadcast (gloo) into {server.url} (rallyrl serve, cpu, float32)"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2]
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3] and served == "3"
    assert all(m["sync/logprob_gap"] < 1e-5 and m["sync/servers_failed"] == 0 for m in metrics)
    assert not (out / "weights").exists()  # nothing went through disk
    assert tensor.returncode == 0, tensor.stderr[-3000:]
    assert "weight sync: tensor (by value) into" in tensor.stderr
    (step,) = read_jsonl(tmp_path / "tensor" / "metrics.jsonl")
    assert step["sync/weight_version"] == 1 and step["sync/logprob_gap"] < 1e-5
    assert not (tmp_path / "tensor" / "weights").exists()


@pytest.mark.slow
def test_the_embedded_engine_takes_the_trainers_tensors_in_process_and_says_so(tmp_path):
    out = tmp_path / "run"
    done = run_cli("train", "--steps", "2", "--prompts-per-step", "2", "-n", "2", "--out", str(out), "--no-progress",
                   "--weight-sync", "tensor", "--set", "weight_sync.check_logprobs=true", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("weight sync: ")]
    assert said == ["weight sync: tensor, in process (LocalEngine takes the trainer's tensors themselves)"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1]
    assert [m["sync/weight_version"] for m in metrics] == [1, 2]
    assert all(m["sync/logprob_gap"] < 1e-5 for m in metrics), [m["sync/logprob_gap"] for m in metrics]
    assert not (out / "weights").exists()
    for_servers = run_cli("train", "--steps", "1", "--prompts-per-step", "1", "-n", "1", "--out", str(tmp_path / "b"),
                          "--no-progress", "--weight-sync", "broadcast", timeout=600)  # fmt: skip
    assert for_servers.returncode == 0, for_servers.stderr[-3000:]
    assert "weight_sync.transport broadcast is for servers (--engine-url)" in for_servers.stderr


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", "tensor"])
async def test_a_restarted_server_comes_back_at_the_current_version_before_it_gets_requests(
    tmp_path, trainer_weights, transport
):
    model, weights = trainer_weights
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2) as servers:
        async with EnginePool([s.url for s in servers], FAST) as pool:
            said = await pool.plan_weight_sync(WeightSyncConfig(transport=transport, bucket_mb=2), weights,
                                               torch.device("cpu"))  # fmt: skip
            assert len(said) == 2 and all(transport in line for line in said)
            step_weights(model, weights, 1)
            assert await pool.push_weights(weights, 1) == {s.url: 1 for s in servers}
            assert await logprob_gap(pool, model, tokenizer, "after-1") < 1e-5
            port = int(servers[1].url.rsplit(":", 1)[1])
            servers[1].kill()
            servers[1] = start_serve(EMBEDDED_MODEL, tmp_path, port)  # the same URL, its checkpoint's weights
            await asyncio.to_thread(wait_healthy, servers[1].url, servers[1].process, servers[1].log)
            for _ in range(100):
                await asyncio.sleep(0.2)
                if all(s.healthy and s.weight_version == 1 for s in pool.servers):
                    break
            assert await pool.server_versions() == {s.url: 1 for s in servers}
            assert await logprob_gap(pool, model, tokenizer, "back") < 1e-5  # the current weights, not its own
            step_weights(model, weights, 2)
            assert await pool.push_weights(weights, 2) == {s.url: 2 for s in servers}
            assert await logprob_gap(pool, model, tokenizer, "after-2") < 1e-5
    assert not (tmp_path / "weights").exists()


@pytest.mark.slow
async def test_a_server_that_stops_answering_mid_update_is_taken_out_and_never_serves_half_its_weights(
    tmp_path, trainer_weights
):
    model, weights = trainer_weights
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2) as (good, stuck):
        async with EnginePool([good.url, stuck.url], FAST) as pool:
            await pool.plan_weight_sync(WeightSyncConfig(bucket_mb=1, timeout_s=3), weights, torch.device("cpu"))
            receiver = pool.servers[1].sync.receiver
            send = receiver.send

            async def stop_before_the_second_bucket(bucket, flat, count, version):
                if bucket.index == 1:
                    os.kill(stuck.process.pid, signal.SIGSTOP)
                await send(bucket, flat, count, version)

            receiver.send = stop_before_the_second_bucket
            step_weights(model, weights, 1)
            started = asyncio.get_running_loop().time()
            versions = await pool.push_weights(weights, 1)
            assert asyncio.get_running_loop().time() - started < 10  # the deadline, not a hang
            assert versions == {good.url: 1, stuck.url: None}
            assert not pool.servers[1].healthy and pool.servers[0].healthy
            receiver.send = send
            os.kill(stuck.process.pid, signal.SIGCONT)
            # it holds one bucket of version 1 and the rest of version 0: it must not generate on that
            status, answer = await asyncio.to_thread(post, f"{stuck.url}/continue_generation", {})
            assert status == 400 and "part of the new weights" in answer["error"]["message"]
            for _ in range(100):  # the health check brings it back: the whole of version 1, then requests
                await asyncio.sleep(0.2)
                if pool.servers[1].healthy:
                    break
            assert await pool.server_versions() == {good.url: 1, stuck.url: 1}
            assert await logprob_gap(pool, model, tokenizer, "whole") < 1e-5


@pytest.mark.slow
def test_a_server_of_another_shape_is_refused_before_the_first_step_naming_the_parameter(tmp_path, tiny_model_dir):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        done = run_cli("train", "--model", str(tiny_model_dir), "--engine-url", server.url, "--steps", "1",
                       "--out", str(tmp_path / "run"), "--no-progress")  # fmt: skip
        served = get_json(f"{server.url}/get_model_info")["weight_version"]
    assert done.returncode == 2, done.stderr[-2000:]
    assert (f"error: {server.url} serves a model of another shape than the trainer's: model.embed_tokens.weight "
            "is [105, 256] there and [105, 64] in the trainer") in done.stderr  # fmt: skip
    assert served == "default" and not (tmp_path / "run" / "metrics.jsonl").exists()
