"""The clients the benchmark measures against the simulated server:

- rallyrl: ``RolloutRunner`` with every request in flight, each moving on as soon as its own
  turn or tool call ends;
- bare: the simplest correct trajectory-level client (``benchmarks/bare_client.py``: raw
  aiohttp, text in and out), the yardstick of rallyrl's client CPU per turn;
- batch-level: the whole batch generates and waits for its slowest member, runs every tool
  call and waits for the slowest, then starts the next turn (how a rollout built on one
  ``generate(batch)`` call per turn behaves), over rallyrl's HTTP client, template and parser.

Each records the client's CPU time, turns and peak RSS while it runs; rallyrl and the
batch-level client also each request's trace (generation and tool segments) for the timeline.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.bare_client import BareClient
from benchmarks.workloads import Scenario
from rollout.engines.base import SamplingParams
from rollout.engines.sglang_http import SGLangHTTPConfig, SGLangHTTPEngine
from rollout.loop import RolloutConfig
from rollout.parsers import get_parser
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState
from rollout.runner import RolloutRunner, old_objects_frozen, request_from_record

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class ClientRun:
    """What one client did: wall time, per-request latencies and traces, its own cost."""

    makespan_s: float
    request_latency_s: list[float]
    turns: int
    started: float
    """``time.monotonic()`` when the client started (the same clock as the server's, on Linux)."""
    cpu_s: float
    peak_rss_mb: float
    cpu_per_turn_windows_us: list[float] = field(default_factory=list)
    segments: list[list[tuple[str, float, float]]] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)


class CountingEngine(SGLangHTTPEngine):
    """The HTTP client, counting finished turns for the CPU-per-turn windows (from its own count of
    attempts, so that counting adds nothing to a turn)."""

    @property
    def turns_done(self) -> int:
        return self._attempts - len(self._wire_rids)  # attempts made, less those in flight


class _Meter:
    """Samples process CPU, finished turns and RSS every ``interval_s`` while a client runs
    (``engine.turns_done`` counts the turns)."""

    def __init__(self, engine: Any, interval_s: float = 0.25):
        self.engine, self.interval_s = engine, interval_s
        self.samples: list[tuple[float, int]] = []
        self.peak_rss = 0

    async def run(self) -> None:
        while True:
            self.samples.append((time.process_time(), self.engine.turns_done))
            self.peak_rss = max(self.peak_rss, _rss_bytes())
            await asyncio.sleep(self.interval_s)

    def windows_us(self) -> list[float]:
        """CPU per finished turn in each window that finished at least 20 turns."""
        out = []
        for (cpu0, turns0), (cpu1, turns1) in zip(self.samples, self.samples[1:], strict=False):
            if turns1 - turns0 >= 20:
                out.append((cpu1 - cpu0) / (turns1 - turns0) * 1e6)
        return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def http_config() -> SGLangHTTPConfig:
    return SGLangHTTPConfig(timeout_s=3600, control_timeout_s=60, max_retries=2)


async def _measured(engine: Any, work: Any) -> tuple[Any, float, float, _Meter]:
    meter = _Meter(engine)
    sampler = asyncio.create_task(meter.run())
    cpu0, t0 = time.process_time(), time.monotonic()
    try:
        result = await work
    finally:
        sampler.cancel()
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    meter.samples.append((time.process_time(), engine.turns_done))
    meter.peak_rss = max(meter.peak_rss, _rss_bytes())
    return result, wall, cpu, meter


def rollout_config(scenario: Scenario) -> RolloutConfig:
    w = scenario.workload
    return RolloutConfig(
        max_turns=w.turns,
        max_new_tokens=w.tokens_per_turn,
        max_model_len=scenario.prompt_tokens + w.turns * (w.tokens_per_turn + scenario.delta_tokens) + 16,
        tool_timeout_s=3600.0,
        max_parallel_calls=1,
    )


def _segments(request: AsyncRolloutRequest, t0: float) -> list[tuple[str, float, float]]:
    names = {RequestState.RUNNING: "running", RequestState.TOOL_CALLING: "tool", RequestState.INTERACTING: "user"}
    out = []
    for event, following in zip(request.trace, request.trace[1:], strict=False):
        if event.state in names:
            out.append((names[event.state], event.t - t0, following.t - t0))
    return out


async def run_rallyrl(scenario: Scenario, url: str) -> ClientRun:
    """All requests through ``RolloutRunner`` at once."""
    records = scenario.records()
    async with CountingEngine(url, http_config()) as engine:
        runner = RolloutRunner(
            engine, scenario.chat, {scenario.tool.name: scenario.tool}, rollout_config(scenario),
            max_concurrency=len(records), progress=False,
        )  # fmt: skip
        t0 = time.monotonic()
        result, wall, cpu, meter = await _measured(engine, runner.run(records, 1))
    return _client_run(result.requests, t0, wall, cpu, meter)


async def run_bare(scenario: Scenario, url: str) -> ClientRun:
    """The bare client, every request at once; the objects that existed before it are left out
    of the cyclic GC's walks, as the runner does for rallyrl."""
    w, records = scenario.workload, scenario.records()
    client = BareClient(url, scenario.tool, w.turns, w.tokens_per_turn, scenario.chat.stop_token_ids)
    t0 = time.monotonic()
    with old_objects_frozen():
        _, wall, cpu, meter = await _measured(client, client.run(records))
    return ClientRun(
        makespan_s=wall,
        request_latency_s=[t - t0 for t in client.finished_at],
        turns=client.turns_done,
        started=t0,
        cpu_s=cpu,
        peak_rss_mb=meter.peak_rss / 2**20,
        cpu_per_turn_windows_us=meter.windows_us(),
        segments=[[] for _ in records],
        finish_reasons=dict(client.finish_reasons),
    )


async def run_batch_level(scenario: Scenario, url: str) -> ClientRun:
    """Turn by turn for the whole batch: generate all, wait for the slowest; call all tools,
    wait for the slowest; repeat."""
    w, chat, tool = scenario.workload, scenario.chat, scenario.tool
    parser = get_parser("qwen25")
    config = rollout_config(scenario)
    requests = [request_from_record(r, i, 0, f"batch-{i}") for i, r in enumerate(scenario.records())]
    sampling = SamplingParams(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, stop_token_ids=chat.stop_token_ids
    )

    async def rollout(engine: CountingEngine) -> None:
        instances = {}
        for request in requests:
            latencies = request.tools_kwargs[tool.name]["create_kwargs"]["latencies"]
            instances[request.request_id] = await tool.create(None, latencies=latencies)
            request.prompt_ids = chat.prompt_ids(request.messages)
        active = requests
        last_output: dict[str, list[int]] = {}
        for _ in range(w.turns):
            for request in active:
                request.transition(RequestState.RUNNING)
            generations = await asyncio.gather(*(engine.generate(r.all_ids, sampling, r.request_id) for r in active))
            calling = []
            for request, generation in zip(active, generations, strict=True):
                request.metrics.turns += 1
                last_output[request.request_id] = generation.output_ids
                request.append_generated(generation.output_ids, generation.output_logprobs, generation.weight_version)
                text = chat.assistant_text(generation.output_ids)
                request.messages.append({"role": "assistant", "content": text})
                if parser(text).calls and request.metrics.turns < w.turns:
                    calling.append(request)
                else:
                    request.finish(FinishReason.STOP)
                    request.transition(RequestState.COMPLETED)
            for request in calling:
                request.transition(RequestState.TOOL_CALLING)
            responses = await asyncio.gather(*(tool.execute(instances[r.request_id], {}) for r in calling))
            for request, response in zip(calling, responses, strict=True):
                tool_message = {"role": "tool", "content": response.text}
                request.messages.append(tool_message)
                glue = chat.assistant_close_ids(last_output[request.request_id])
                request.append_context(glue + chat.delta_ids([tool_message]))
                request.metrics.tool_calls += 1
            active = calling
        for request in requests:
            await tool.release(instances[request.request_id])

    async with CountingEngine(url, http_config()) as engine:
        t0 = time.monotonic()
        _, wall, cpu, meter = await _measured(engine, rollout(engine))
    return _client_run(requests, t0, wall, cpu, meter)


def _client_run(requests: list[AsyncRolloutRequest], t0: float, wall: float, cpu: float, meter: _Meter) -> ClientRun:
    reasons = Counter(r.finish_reason.value if r.finish_reason else "none" for r in requests)
    return ClientRun(
        makespan_s=wall,
        request_latency_s=[r.trace[-1].t - t0 for r in requests],
        turns=sum(r.metrics.turns for r in requests),
        started=t0,
        cpu_s=cpu,
        peak_rss_mb=meter.peak_rss / 2**20,
        cpu_per_turn_windows_us=meter.windows_us(),
        segments=[_segments(r, t0) for r in requests],
        finish_reasons=dict(reasons),
    )
