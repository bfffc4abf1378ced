"""Rollouts and training against real ``rallyrl serve`` processes on loopback: one server, a pool
of two (one of them killed mid-rollout), a weight update mid-rollout, GRPO steps that update
both servers, and two servers behind the real sglang-router."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM

from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.pool import EnginePool, PoolConfig
from rollout.engines.sglang_http import SGLangHTTPConfig, SGLangHTTPEngine
from rollout.loop import RolloutConfig
from rollout.request import validate_trajectory
from rollout.runner import RolloutRunner
from rollout.serve.processes import free_port, serve_processes
from rollout.tokens import ChatTokenizer, load_tokenizer
from tests.conftest import run_cli
from tools.registry import DEFAULT_TOOLS, build_tools

CALC = RolloutConfig(max_turns=3, max_new_tokens=96, max_model_len=1024)


def calc_runner(engine, max_concurrency: int = 64, config: RolloutConfig = CALC) -> RolloutRunner:
    tools = build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [tool.schema for tool in tools.values()])
    return RolloutRunner(engine, chat, tools, config, max_concurrency=max_concurrency, progress=False)


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return orjson.loads(response.read())


def assert_all_accounted(result, out: Path, expected: int) -> None:
    """Count in = count out, no duplicate, every line valid, every error recorded."""
    lines = read_jsonl(out)
    ids = [line["request_id"] for line in lines]
    assert len(result.requests) == expected
    assert len(lines) == expected
    assert len(set(ids)) == expected
    for line in lines:
        validate_trajectory(line)
        if line["finish_reason"] == "error":
            assert line["error"], line["request_id"]


@pytest.mark.slow
async def test_rollout_through_one_server(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        async with SGLangHTTPEngine(server.url) as engine:
            result = await calc_runner(engine).run(make_task("calc", 32, seed=3), 2, tmp_path / "out.jsonl")
    assert_all_accounted(result, tmp_path / "out.jsonl", 64)
    assert result.summary.finish_reasons.get("error", 0) == 0
    assert result.summary.consistency_failures == 0
    assert result.summary.tool_calls > 0  # real multi-turn conversations went through HTTP
    assert all(r.weight_versions and set(v for v in r.weight_versions if v is not None) == {0} for r in result.requests)


@pytest.mark.slow
async def test_pool_routes_to_both_servers_and_keeps_a_request_on_one(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2) as servers:
        async with EnginePool([s.url for s in servers]) as pool:
            served: dict[str, set[str]] = {}
            generate = pool.generate

            async def recording(input_ids, sampling, rid):
                generation = await generate(input_ids, sampling, rid)
                served.setdefault(rid, set()).add(generation.meta["server"])
                return generation

            pool.generate = recording  # type: ignore[method-assign]
            result = await calc_runner(pool).run(make_task("calc", 48, seed=4), 2, tmp_path / "out.jsonl")
            stats = pool.stats()
    assert_all_accounted(result, tmp_path / "out.jsonl", 96)
    assert result.summary.finish_reasons.get("error", 0) == 0
    assert all(s["requests"] > 10 for s in stats["servers"].values()), stats  # least-in-flight spreads them
    multi_turn = [r for r in result.requests if r.metrics.turns > 1]
    assert multi_turn
    assert all(len(served[r.request_id]) == 1 for r in multi_turn)  # later turns stick to the first server


@pytest.mark.slow
async def test_killing_one_of_two_servers_mid_rollout_loses_no_request(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2) as servers:
        config = PoolConfig(health_interval_s=0.2, client=SGLangHTTPConfig(max_retries=1, backoff_s=0.05))
        async with EnginePool([s.url for s in servers], config) as pool:
            victim = pool.servers[0]
            rollout = asyncio.create_task(
                calc_runner(pool, max_concurrency=96).run(make_task("calc", 128, seed=5), 2, tmp_path / "out.jsonl")
            )
            deadline = time.monotonic() + 60
            while not (victim.stats.requests >= 20 and victim.engine.in_flight >= 5):
                assert time.monotonic() < deadline and not rollout.done(), "the rollout never loaded the victim"
                await asyncio.sleep(0.01)
            in_flight_at_kill = victim.engine.in_flight
            await asyncio.to_thread(servers[0].kill)
            result = await rollout
            stats = pool.stats()
    assert_all_accounted(result, tmp_path / "out.jsonl", 256)
    assert in_flight_at_kill >= 5
    assert stats["failovers"] >= 1  # requests in flight on the dead server were retried on the other
    assert not stats["servers"][servers[0].url]["healthy"]
    errors = [r for r in result.requests if r.finish_reason.value == "error"]
    assert all(r.error for r in errors)
    assert len(errors) == 0, [r.error for r in errors[:3]]  # the survivor served every one of them


def save_perturbed_model(source: Path, target: Path, scale: float = 1.5) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "mlp" in name:
                parameter.mul_(scale)
    model.save_pretrained(target)
    load_tokenizer(source).save_pretrained(target)
    return target


@pytest.mark.slow
async def test_weight_update_mid_rollout_gives_trajectories_both_versions(tmp_path, tiny_model_dir):
    new_weights = save_perturbed_model(tiny_model_dir, tmp_path / "v1")
    config = RolloutConfig(max_turns=1, max_new_tokens=160, max_model_len=2048, check_consistency=False)
    with serve_processes(tiny_model_dir, tmp_path, 1, "--weights-dir", str(tmp_path)) as (server,):
        async with SGLangHTTPEngine(server.url) as engine:
            rollout = asyncio.create_task(
                calc_runner(engine, max_concurrency=32, config=config).run(
                    make_task("calc", 32, seed=6), 2, tmp_path / "out.jsonl"
                )
            )
            while engine.in_flight < 16:  # wait for generations to be under way
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)
            assert not rollout.done()
            await engine.sync_weights_from_disk(str(new_weights), 1)
            result = await rollout
            server_version = await engine.get_weight_version()
    assert_all_accounted(result, tmp_path / "out.jsonl", 64)
    assert server_version == 1
    assert_resumed_across_the_update(result)


def assert_resumed_across_the_update(result) -> None:
    """No request failed or was aborted, and some spanned the update: old tokens first, then new
    ones, every kept token with its logprob and weight version."""
    assert not [r.error for r in result.requests if r.finish_reason.value in ("error", "abort")]
    spanning = [r for r in result.requests if {0, 1} <= set(r.weight_versions)]
    assert spanning, "no trajectory was under way during the update"
    for request in spanning:
        versions = [v for v in request.weight_versions if v is not None]
        assert versions == sorted(versions)
        assert len(request.response_ids) == len(request.logprobs) == len(request.weight_versions)


@pytest.mark.slow
def test_three_grpo_steps_against_two_servers_update_both_through_disk(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2, "--weights-dir", str(tmp_path / "run")) as servers:
        out = tmp_path / "run"
        urls = [arg for s in servers for arg in ("--engine-url", s.url)]
        trained = run_cli("train", "--steps", "3", "--prompts-per-step", "4", "-n", "4", "--out", str(out),
                          "--no-progress", "--weight-sync", "disk", *urls)  # fmt: skip
        assert trained.returncode == 0, trained.stderr
        assert trained.stderr.count("weight sync: disk (a saved model directory) into") == 2
        versions = [get_json(f"{s.url}/get_model_info")["weight_version"] for s in servers]
    assert versions == ["3", "3"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2]
    assert all(m["rollout/staleness_mean"] == 0 and m["rollout/staleness_max"] == 0 for m in metrics)
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["v000002", "v000003"]  # older ones removed
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow
def test_async_grpo_against_two_servers_keeps_requests_going_through_the_syncs(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2, "--weights-dir", str(tmp_path / "run")) as servers:
        out = tmp_path / "run"
        urls = [arg for s in servers for arg in ("--engine-url", s.url)]
        trained = run_cli("train", "--steps", "4", "--prompts-per-step", "4", "-n", "4", "--out", str(out),
                          "--no-progress", "--async", "--max-staleness", "1", *urls)  # fmt: skip
        assert trained.returncode == 0, trained.stderr
        versions = [get_json(f"{s.url}/get_model_info")["weight_version"] for s in servers]
    assert versions == ["4", "4"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics)
    assert all(m["rollout/groups_trained"] + m["rollout/draw_cap_hit"] >= 1 for m in metrics)
    assert all(m["rollout/error_rate"] == 0 for m in metrics)  # paused requests resumed, none failed


@contextlib.contextmanager
def router(worker_urls: list[str], log: Path):
    port = free_port()
    command = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
    ]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # /health answers before the workers are registered; /readiness after
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the router never became ready:\n{log.read_text()}"
            with contextlib.suppress(OSError):
                if get_json(f"{url}/readiness").get("healthy_workers") == len(worker_urls):
                    break
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="pip install sglang-router")
async def test_rollout_through_sglang_router_in_front_of_two_servers(tmp_path):
    with (
        serve_processes(EMBEDDED_MODEL, tmp_path, 2) as servers,
        router([s.url for s in servers], tmp_path / "router.log") as url,
    ):
        async with SGLangHTTPEngine(url) as engine:
            result = await calc_runner(engine).run(make_task("calc", 24, seed=7), 2, tmp_path / "out.jsonl")
        served = [get_json(f"{s.url}/get_server_info")["internal_states"][0]["requests"] for s in servers]
    assert_all_accounted(result, tmp_path / "out.jsonl", 48)
    assert result.summary.finish_reasons.get("error", 0) == 0
    assert result.summary.consistency_failures == 0
    assert all(count > 0 for count in served), served  # the router spread the requests over both


@pytest.mark.slow
def test_cli_rollout_with_engine_url_writes_valid_trajectories(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        out = tmp_path / "rollouts.jsonl"
        made = run_cli("rollout", "--num-prompts", "16", "-n", "2", "--engine-url", server.url, "--out", str(out),
                       "--no-progress")  # fmt: skip
        assert made.returncode == 0, made.stderr
        served = get_json(f"{server.url}/get_server_info")["internal_states"][0]["requests"]
    assert len(read_jsonl(out)) == 32
    assert served >= 32
    assert run_cli("check", str(out)).returncode == 0


@pytest.mark.slow
def test_serve_on_a_taken_port_fails_with_a_clear_error(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        port = server.url.rsplit(":", 1)[1]
        again = run_cli("serve", "--port", port, timeout=120)
    assert again.returncode == 2
    assert f"cannot serve on 127.0.0.1:{port}" in again.stderr


@pytest.mark.slow
def test_rollout_against_an_unreachable_server_is_a_clear_error_before_any_request(tmp_path):
    """Asking what kind of server it is (SGLang or vLLM) fails first, naming the URL."""
    out = tmp_path / "rollouts.jsonl"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    made = run_cli("rollout", "--num-prompts", "4", "--engine-url", url, "--out", str(out), "--no-progress")
    assert made.returncode == 2
    assert url in made.stderr and "is the server up?" in made.stderr


@pytest.mark.slow
def test_rollout_against_an_unreachable_sglang_server_ends_every_request_with_an_error(tmp_path):
    """Named, the server is not asked: every request is tried, and each ends with the error, written;
    then the command exits 1 naming the first (every trajectory errored: fail_at_error_rate 1)."""
    out = tmp_path / "rollouts.jsonl"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    made = run_cli("rollout", "--num-prompts", "4", "--engine-url", url, "--engine-server", "sglang", "--out",
                   str(out), "--no-progress")  # fmt: skip
    assert made.returncode == 1, made.stderr
    assert "error: 100% of the trajectories ended in an error" in made.stderr and url in made.stderr
    lines = read_jsonl(out)
    assert len(lines) == 4
    assert all(line["finish_reason"] == "error" and url in line["error"] for line in lines)
