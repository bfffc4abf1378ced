"""The concurrency benchmark: the bound on cases worked out by hand, the latency tools, the
simulated server's answers, and a tiny end-to-end run whose report must be well formed (the
figures themselves are the benchmark's business, not the suite's)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import orjson
import pytest
from rich.console import Console

from benchmarks.bare_client import BareClient
from benchmarks.bound import asynchronous_bound, batch_level_bound
from benchmarks.clients import ClientRun
from benchmarks.sim_tools import Fixed, LogNormal, SimTool, Uniform
from benchmarks.tool_concurrency import UVLOOP_ROW, run_benchmark, sim_server
from benchmarks.workloads import W1, W3, Scenario, Workload
from rollout.engines.base import SamplingParams
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.event_loop import uvloop_installed
from tests.conftest import run_cli

STEP = 0.01


def scenario(latencies: list[list[float]], turns: int, capacity: int, tokens: int = 48) -> Scenario:
    workload = Workload("T", requests=len(latencies), turns=turns, capacity=capacity, tokens_per_turn=tokens,
                        decode_step_s=STEP, prefill_s_per_token=0.0, tool_latency=Fixed(0.0))  # fmt: skip
    built = Scenario.build(workload)
    built.latencies = np.array(latencies, dtype=float).reshape(len(latencies), turns - 1)
    return built


def test_bound_of_one_request_is_its_turns_plus_its_tool_call():
    result = asynchronous_bound(scenario([[0.5]], turns=2, capacity=4))
    assert result.makespan_s == pytest.approx(48 * STEP + 0.5 + 48 * STEP)


def test_bound_queues_requests_beyond_capacity():
    result = asynchronous_bound(scenario([[], [], []], turns=1, capacity=2))
    assert result.makespan_s == pytest.approx(2 * 48 * STEP)  # the third waits for a slot
    assert sorted(result.request_latency_s) == pytest.approx([48 * STEP, 48 * STEP, 96 * STEP])


def test_batch_level_bound_waits_for_the_slowest_tool_call():
    built = scenario([[0.1], [0.9]], turns=2, capacity=2)
    assert batch_level_bound(built).makespan_s == pytest.approx(48 * STEP + 0.9 + 48 * STEP)
    # asynchronously the fast request finishes early, but the makespan is the slow one's
    assert asynchronous_bound(built).request_latency_s[0] == pytest.approx(48 * STEP + 0.1 + 48 * STEP)


def test_a_rate_limited_tool_serialises_the_calls_in_the_bound():
    built = scenario([[0.5], [0.5]], turns=2, capacity=2)
    built.workload = dataclasses.replace(built.workload, tool_max_concurrent=1)
    assert asynchronous_bound(built).makespan_s == pytest.approx(48 * STEP + 1.0 + 48 * STEP)


def test_latency_models_sample_their_distributions():
    rng = np.random.default_rng(0)
    assert (Fixed(0.3).sample(rng, (4,)) == 0.3).all()
    uniform = Uniform(0.1, 0.2).sample(rng, (1000,))
    assert uniform.min() >= 0.1 and uniform.max() <= 0.2
    lognormal = LogNormal(0.2, 1.0).sample(rng, (20000,))
    assert np.median(lognormal) == pytest.approx(0.2, rel=0.05)
    assert np.percentile(lognormal, 99) > 5 * np.median(lognormal)  # the heavy tail


async def test_a_rate_limited_tool_runs_at_most_m_calls_at_once():
    tool = SimTool({"max_concurrent": 3})
    instances = [await tool.create(None, latencies=[0.05]) for _ in range(10)]
    await asyncio.gather(*(tool.execute(i, {}) for i in instances))
    assert tool.peak_running == 3


async def test_the_simulated_server_answers_a_tool_call_then_the_final_answer():
    built = Scenario.build(dataclasses.replace(W1, requests=1, turns=2, decode_step_s=0.001))
    chat = built.chat
    sampling = SamplingParams(max_new_tokens=64, stop_token_ids=chat.stop_token_ids)
    prompt = chat.prompt_ids(built.records()[0].prompt)
    with sim_server(built) as (url, stats):
        async with SGLangHTTPEngine(url) as engine:
            first = await engine.generate(prompt, sampling, "conv")
            follow = prompt + first.output_ids + chat.assistant_close_ids(first.output_ids)
            follow += chat.delta_ids([{"role": "tool", "content": "done"}])
            second = await engine.generate(follow, sampling, "conv")
        served = stats()
    assert first.output_ids == built.tool_turn_ids and first.finish_reason == "stop"
    assert "<tool_call>" in chat.assistant_text(first.output_ids)
    assert second.output_ids == built.final_ids
    assert served["requests"] == 2 and served["steps"] >= 2 * W1.tokens_per_turn


async def test_the_bare_client_writes_exactly_what_the_chat_template_renders():
    built = Scenario.build(dataclasses.replace(W1, requests=3, decode_step_s=0.0005, tool_latency=Fixed(0.001)))
    chat, records = built.chat, built.records()
    with sim_server(built) as (url, _):
        client = BareClient(url, built.tool, W1.turns, W1.tokens_per_turn, chat.stop_token_ids)
        await client.run(records)
    assert client.turns_done == 3 * W1.turns and client.finish_reasons == {"stop": 3}
    for record, text in zip(records, client.conversations, strict=True):
        messages = list(record.prompt)
        for _ in range(W1.turns - 1):
            messages += [{"role": "assistant", "content": chat.assistant_text(built.tool_turn_ids)},
                         {"role": "tool", "content": "done"}]  # fmt: skip
        messages.append({"role": "assistant", "content": chat.assistant_text(built.final_ids)})
        assert chat.render(messages) == text + chat.decode(chat.turn_close_ids)


@pytest.mark.slow
def test_a_tiny_benchmark_run_gives_a_well_formed_report(tmp_path):
    fast_tool = LogNormal(0.02, 1.0)
    tiny = [
        dataclasses.replace(W1, requests=24, capacity=8, tokens_per_turn=40, tool_latency=fast_tool),
        dataclasses.replace(W3, requests=48, capacity=16, tokens_per_turn=40),
    ]
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "timeline.png"
    results = run_benchmark(tiny, json_path, plot_path, Console(quiet=True))
    report = orjson.loads(json_path.read_bytes())
    assert [r["workload"]["name"] for r in report] == ["W1", "W3"]
    uvloop = [UVLOOP_ROW] if uvloop_installed() else []  # (rallyrl[uvloop], in dev)
    for result in report:
        systems = [row["system"] for row in result["rows"]]
        assert systems == ["bound", "rallyrl", "bare", *uvloop, "batch-level bound", "batch-level"]
        rallyrl = result["rows"][1]
        for key in ("makespan_s", "efficiency", "speedup_over_batch", "latency_p50_s", "latency_p99_s",
                    "utilisation", "client_cpu_per_turn_us", "peak_rss_mb", "server_lateness_p99_ms"):  # fmt: skip
            assert isinstance(rallyrl[key], float) and rallyrl[key] >= 0, key
        assert 0 < rallyrl["efficiency"] <= 1.05
        assert rallyrl["turns"] == result["workload"]["requests"] * result["workload"]["turns"]
        assert rallyrl["finish_reasons"] == {"stop": result["workload"]["requests"]}
        bare = result["rows"][2]
        assert bare["turns"] == rallyrl["turns"] and bare["cpu_per_turn_vs_bare"] == 1.0
        assert rallyrl["cpu_per_turn_vs_bare"] == rallyrl["client_cpu_per_turn_us"] / bare["client_cpu_per_turn_us"]
    assert plot_path.stat().st_size > 10_000
    assert len(results[0]["timelines"]["rallyrl"]) == 24


def test_rounds_alternate_the_clients_and_report_each_ones_median_round(monkeypatch):
    from benchmarks import tool_concurrency

    order: list[str] = []
    cpu = {"rallyrl": iter([3.0, 1.0, 2.0]), "bare": iter([1.0, 5.0, 3.0]), "rallyrl on uvloop": iter([1.0, 2.0, 0.5]),
           "batch-level": iter([4.0])}  # fmt: skip

    def fake(name):
        async def client(scenario, url):
            on_uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
            row = "rallyrl on uvloop" if on_uvloop else name
            order.append(row)
            return ClientRun(makespan_s=1.0, request_latency_s=[1.0], turns=1_000_000, started=0.0,
                             cpu_s=next(cpu[row]), peak_rss_mb=1.0)  # fmt: skip

        return client

    monkeypatch.setattr(tool_concurrency, "run_rallyrl", fake("rallyrl"))
    monkeypatch.setattr(tool_concurrency, "run_bare", fake("bare"))
    monkeypatch.setattr(tool_concurrency, "run_batch_level", fake("batch-level"))
    tiny = dataclasses.replace(W1, requests=4, capacity=2, tokens_per_turn=40, tool_latency=LogNormal(0.01, 1.0))
    result = tool_concurrency.run_workload(tiny, Console(quiet=True), rounds=3)
    assert order == ["rallyrl", "bare", "rallyrl on uvloop"] * 3 + ["batch-level"]  # (uvloop: the dev extra has it)
    rallyrl, bare, uvloop = result["rows"][1], result["rows"][2], result["rows"][3]
    assert uvloop["system"] == "rallyrl on uvloop"
    assert rallyrl["client_cpu_per_turn_rounds_us"] == [3.0, 1.0, 2.0]
    assert bare["client_cpu_per_turn_rounds_us"] == [1.0, 5.0, 3.0]
    assert rallyrl["client_cpu_per_turn_us"] == 2.0 and bare["client_cpu_per_turn_us"] == 3.0
    assert rallyrl["cpu_per_turn_vs_bare"] == 2.0 / 3.0
    assert uvloop["client_cpu_per_turn_us"] == 1.0 and uvloop["cpu_per_turn_vs_bare"] == 1.0 / 3.0


@pytest.mark.slow
def test_bench_rejects_an_unknown_workload():
    made = run_cli("bench", "--workload", "W9")
    assert made.returncode == 2
    assert "W1, W2, W3" in made.stderr


@pytest.mark.slow  # (two simulated servers and a rollout: about 10 s)
def test_many_in_flight_runs_every_request_over_a_pool_against_the_bound_of_its_routing():
    from benchmarks.many_in_flight import measure

    row = measure(requests=96, servers=2, capacity=16, decode_step_s=0.005, loop="asyncio")
    assert row["trajectories"] == 96 and row["turns"] == 96 * W1.turns and "error" not in row["finish_reasons"]
    assert 0.3 < row["efficiency"] <= 1.02  # (the routed bound is exact: a run cannot beat it by more than noise)
    assert 1 <= row["peak_sockets"] <= 2 * 96 and row["fd_limit"] >= 96  # (idle keep-alive ones included)
