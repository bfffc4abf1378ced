"""8,192 requests in flight from one client process: W1's conversation (4 turns, 3 tool calls with
lognormal latencies) for 8,192 requests at once, over an engine pool of several simulated servers.

    python -m benchmarks.many_in_flight [--requests 8192] [--servers 4] [--capacity 512] [--loop auto]

Every request is started at once (``max_concurrency`` = requests) through ``RolloutRunner`` and an
``EnginePool`` of ``--servers`` simulated SGLang servers (``benchmarks/sim_server.py``, processes of
their own on the same cores), each decoding ``--capacity`` sequences at a time, ``--decode-step-ms``
a step (50 by default, W1's is 5: the same conversation on a larger model, so that four servers and
the client fit two cores between them; at 20 ms the two cores are what limits the run). Reported:
efficiency (the bound / the makespan; the bound simulates each server with zero client cost on the
requests the pool sent it, so it is exact for the run's routing), the client's CPU per turn, its
memory per request in flight (peak RSS over the RSS before the run, divided by the requests), the
sockets it held at the peak (sampled every 0.25 s), the file-descriptor limit in force
(``rollout/open_files.py`` raised it) and the servers' step lateness.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.bound import asynchronous_bound
from benchmarks.clients import _rss_bytes, http_config, rollout_config
from benchmarks.tool_concurrency import sim_server
from benchmarks.waits import finish_within
from benchmarks.workloads import W1, Scenario
from rollout.engines.config import PoolConfig
from rollout.engines.pool import EnginePool
from rollout.event_loop import resolve
from rollout.event_loop import run as run_on_loop
from rollout.open_files import open_now
from rollout.runner import RolloutRunner
from rollout.serve.processes import stop_on_sigterm

RUN_TIMEOUT_S = 900.0


class _Sampler:
    """Open sockets, turns done and RSS every ``interval_s`` while the run goes on."""

    def __init__(self, pool: EnginePool, interval_s: float = 0.25):
        self.pool, self.interval_s = pool, interval_s
        self.peak_sockets = self.peak_fds = self.peak_rss = 0

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def sample(self) -> None:
        sockets = sum(server.engine._wire.open_connections for server in self.pool.servers if server.engine._wire)
        self.peak_sockets = max(self.peak_sockets, sockets)
        self.peak_fds = max(self.peak_fds, open_now())
        self.peak_rss = max(self.peak_rss, _rss_bytes())


async def run_rallyrl(scenario: Scenario, urls: list[str]) -> dict[str, Any]:
    """Every request at once through a pool of ``urls``; the run's figures."""
    import resource

    records = scenario.records()
    rss_before = _rss_bytes()
    config = PoolConfig(client=http_config(), sticky_entries=2 * len(records))  # (every request's server kept)
    async with EnginePool(urls, config, server="sglang") as pool:
        runner = RolloutRunner(pool, scenario.chat, {scenario.tool.name: scenario.tool}, rollout_config(scenario),
                               max_concurrency=len(records), progress=False)  # fmt: skip
        sampler = _Sampler(pool)
        sampling = asyncio.create_task(sampler.run())
        cpu0, t0 = time.process_time(), time.monotonic()
        try:
            result = await runner.run(records, 1)
        finally:
            sampling.cancel()
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        sampler.sample()
        served_by = {int(rid.split("-")[1]): index for rid, index in pool._sticky.items()}  # record -> server
    turns = sum(r.metrics.turns for r in result.requests)
    reasons = sorted({r.finish_reason.value for r in result.requests if r.finish_reason})
    return {
        "makespan_s": wall, "cpu_per_turn_us": cpu / max(turns, 1) * 1e6, "turns": turns,
        "memory_per_request_kb": (sampler.peak_rss - rss_before) / len(records) / 1024,
        "peak_rss_mb": sampler.peak_rss / 2**20, "peak_sockets": sampler.peak_sockets,
        "peak_fds": sampler.peak_fds, "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "finish_reasons": reasons, "trajectories": len(result.requests), "served_by": served_by,
    }  # fmt: skip


def routed_bound(scenario: Scenario, served_by: dict[int, int], servers: int) -> float:
    """The bound of the run's own routing: each server simulated with the requests the pool sent it
    (zero client cost); the makespan is the last server's."""
    makespans = []
    for server in range(servers):
        rows = sorted(record for record, index in served_by.items() if index == server)
        if rows:
            workload = dataclasses.replace(scenario.workload, requests=len(rows))
            part = dataclasses.replace(scenario, workload=workload, latencies=scenario.latencies[rows])
            makespans.append(asynchronous_bound(part).makespan_s)
    return max(makespans)


def measure(requests: int, servers: int, capacity: int, decode_step_s: float, loop: str,
            run_timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
    """One rallyrl run on ``loop`` and the bound of its routing."""
    workload = dataclasses.replace(W1, name=f"W1-{requests}", requests=requests, capacity=capacity,
                                   decode_step_s=decode_step_s)  # fmt: skip
    scenario = Scenario.build(workload)
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(sim_server(scenario)) for _ in range(servers)]
        what = f"the rollout of {requests} requests"
        urls = [url for url, _ in started]
        figures = run_on_loop(finish_within(run_rallyrl(scenario, urls), run_timeout_s, what, "--run-timeout-s"), loop)
        figures["server_lateness_p99_ms"] = max(stats()["lateness_p99_ms"] for _, stats in started)
    if len(figures["served_by"]) != requests:
        raise RuntimeError(f"the pool kept the server of {len(figures['served_by'])} of {requests} requests")
    bound_s = routed_bound(scenario, figures.pop("served_by"), servers)
    return {**figures, "bound_s": bound_s, "efficiency": bound_s / figures["makespan_s"],
            "requests": requests, "servers": servers, "capacity": capacity, "loop": resolve(loop),
            "decode_step_ms": decode_step_s * 1e3}  # fmt: skip


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title="requests in flight from one client process (W1's conversation, an engine pool)")
    for column in ["requests", "servers x capacity", "loop", "bound s", "makespan s", "efficiency",
                   "CPU/turn us", "memory/request KB", "peak sockets", "peak fds", "fd limit",
                   "server late p99 ms"]:  # fmt: skip
        out.add_column(column, justify="right")
    for row in rows:
        out.add_row(str(row["requests"]), f"{row['servers']} x {row['capacity']}", row["loop"], f"{row['bound_s']:.2f}",
                    f"{row['makespan_s']:.2f}", f"{row['efficiency']:.3f}", f"{row['cpu_per_turn_us']:.0f}",
                    f"{row['memory_per_request_kb']:.1f}", str(row["peak_sockets"]), str(row["peak_fds"]),
                    str(row["fd_limit"]), f"{row['server_lateness_p99_ms']:.0f}")  # fmt: skip
    return out


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8192)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=512, help="sequences each server decodes at once")
    parser.add_argument("--decode-step-ms", type=float, default=50.0)
    parser.add_argument("--loop", nargs="+", default=["auto"], choices=["auto", "asyncio", "uvloop"],
                        help="event loop(s) of the client, one run each (--loop asyncio uvloop)")
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    args = parser.parse_args()
    rows = []
    for loop in args.loop:
        rows.append(measure(args.requests, args.servers, args.capacity, args.decode_step_ms / 1e3, loop,
                            args.run_timeout_s))  # fmt: skip
        Console().print(rows[-1], highlight=False)
    Console(width=200).print(table(rows))


if __name__ == "__main__":
    main()
