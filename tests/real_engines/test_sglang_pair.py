"""Two real SGLang servers on this CPU (one of the session's, one of this module's): behind sglang-router
and behind our pool; a training run that broadcasts its weights into both every step
(``rollout/engines/weight_push.py``); one killed between steps and restarted, brought back to the
current version by a new broadcast group; and servers of another model's shape (SGLang and vLLM)
refused before the first step, naming the parameter. One-server training runs: ``test_sglang.py`` and
``test_vllm.py``; the same against ``rallyrl serve``: ``tests/test_weight_sync_serve.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.config import WeightSyncConfig
from rollout.engines.pool import EnginePool, PoolConfig
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.tokens import load_tokenizer
from tests.conftest import run_cli, step_weights
from tests.real_engines.conftest import RestartableServer, require_engine
from tests.test_serve_processes import assert_all_accounted, calc_runner, get_json, read_jsonl, router
from trainer.weight_check import logprob_gap
from trainer.weight_source import PolicyWeights


@pytest.fixture(scope="module")
def second_sglang(engine_logs) -> Iterator[RestartableServer]:
    """A second real SGLang server of the embedded model, for this module's tests (which change its
    weights and restart it, the last ones); started and stopped with the module (three SGLang servers
    at once are as many as this machine's memory holds beside the rest)."""
    require_engine("sglang")
    server = RestartableServer("sglang", engine_logs, "--enable-metrics")  # (the router test reads its counters)
    try:
        yield server
    finally:
        server.process.stop(timeout_s=20)


def served_requests(url: str) -> float:
    """Requests a server started with ``--enable-metrics`` has finished (its Prometheus counter)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))  # fmt: skip


async def test_two_real_servers_behind_sglang_router_and_behind_our_pool(sglang_url, second_sglang, tmp_path):
    urls = [sglang_url, second_sglang.url]
    before = [served_requests(u) for u in urls]
    with router(urls, tmp_path / "router.log") as url:
        async with SGLangHTTPEngine(url) as engine:
            routed = await calc_runner(engine).run(make_task("calc", 16, seed=7), 2, tmp_path / "router.jsonl")
    after_router = [served_requests(u) for u in urls]
    out = tmp_path / "pool.jsonl"
    pooled = run_cli("rollout", "--num-prompts", "16", "-n", "2", "--out", str(out), "--no-progress",
                     *[arg for u in urls for arg in ("--engine-url", u)])  # fmt: skip
    assert pooled.returncode == 0, pooled.stderr
    after_pool = [served_requests(u) for u in urls]
    assert_all_accounted(routed, tmp_path / "router.jsonl", 32)
    assert routed.summary.finish_reasons.get("error", 0) == 0
    assert routed.summary.consistency_failures == 0
    assert all(b > a for a, b in zip(before, after_router, strict=True)), (before, after_router)  # spread
    lines = read_jsonl(out)
    assert len(lines) == 32 and all(line["finish_reason"] in ("stop", "length") for line in lines)
    assert all(b > a for a, b in zip(after_router, after_pool, strict=True)), (after_router, after_pool)


def test_training_broadcasts_into_two_sglang_servers_every_step(sglang_scratch_url, second_sglang, tmp_path):
    out = tmp_path / "run"
    urls = [sglang_scratch_url, second_sglang.url]
    trained = run_cli("train", "--steps", "3", "--prompts-per-step", "4", "-n", "4", "--out", str(out),
                      "--no-progress", "--set", "weight_sync.check_logprobs=true",
                      *[arg for url in urls for arg in ("--engine-url", url)], timeout=900)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    said = sorted(line for line in trained.stderr.splitlines() if line.startswith("weight sync: "))
    assert said == sorted(f"weight sync: broadcast (gloo) into {url} (SGLang 0.5.23, cpu, float32)" for url in urls)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2]
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3]  # the lowest either server reported
    assert all(m["sync/servers_failed"] == 0 and m["sync/logprob_gap"] < 1e-5 for m in metrics)  # on both servers
    assert [get_json(f"{url}/get_model_info")["weight_version"] for url in urls] == ["3", "3"]
    assert not (out / "weights").exists()


async def test_an_sglang_server_restarted_between_steps_comes_back_at_the_current_version(
    sglang_scratch_url, second_sglang, tmp_path
):
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    weights = PolicyWeights.of_model(model, tokenizer, tmp_path / "weights")
    urls = [sglang_scratch_url, second_sglang.url]
    async with EnginePool(urls, PoolConfig(health_interval_s=0.5)) as pool:
        await pool.plan_weight_sync(WeightSyncConfig(), weights, torch.device("cpu"))
        step_weights(model, weights, 1)
        assert await pool.push_weights(weights, 1) == dict.fromkeys(urls, 1)
        assert await logprob_gap(pool, model, tokenizer, "step-1") < 1e-5
        await asyncio.to_thread(second_sglang.restart)  # killed; back at the same URL with its checkpoint
        for _ in range(240):
            await asyncio.sleep(0.5)
            if all(s.healthy and s.weight_version == 1 for s in pool.servers):
                break
        assert await pool.server_versions() == dict.fromkeys(urls, 1)  # brought back by a new group
        assert await logprob_gap(pool, model, tokenizer, "back") < 1e-5
        step_weights(model, weights, 2)
        assert await pool.push_weights(weights, 2) == dict.fromkeys(urls, 2)
        assert await logprob_gap(pool, model, tokenizer, "step-2") < 1e-5
    assert not (tmp_path / "weights").exists()


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_a_server_of_another_shape_is_refused_before_the_first_step(server, request, tiny_model_dir, tmp_path):
    require_engine(server)
    url = request.getfixturevalue(f"{server}_url")
    done = run_cli("train", "--model", str(tiny_model_dir), "--engine-url", url, "--steps", "1",
                   "--out", str(tmp_path / "run"), "--no-progress")  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert (f"error: {url} serves a model of another shape than the trainer's: model.embed_tokens.weight "
            "is [105, 256] there and [105, 64] in the trainer") in done.stderr  # fmt: skip
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
