"""Soak test: 10,000 requests with engine and tool faults on; nothing may be lost or duplicated.

    python -m benchmarks.soak [--requests 10000] [--servers 2] [--out soak.jsonl]

Two ``rallyrl serve`` processes answer a share of ``/generate`` calls with HTTP 500, hang past
the client's timeout, or drop the connection in the middle of the response
(``--fault-*-rate``); one of them is killed a third of the way through and restarted at two
thirds. The calculator tool fails too: it raises, hangs past the tool timeout, returns the
wrong type or a huge output, and its create and release fail now and then. The rollout goes
through a pool (``rollout/engines/pool.py``) and writes JSONL as requests finish.

Printed: requests in, completed, errored, lost (must be 0), duplicated (must be 0), every
JSONL line valid, create/release balance, peak RSS; then PASS, or FAIL with what went wrong and
exit status 1. Not part of CI (it takes minutes); ``--requests 200`` is a quick check. Servers
are started with ``rollout/serve/processes.py`` and stopped on every way out (Ctrl-C and SIGTERM
included); the soak has ``--timeout-s`` (3600) in all, and each server ``--startup-timeout-s`` (90)
to answer ``/health``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import resource
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from benchmarks.waits import WaitTimeout
from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.config import RolloutConfig
from rollout.engines.config import PoolConfig, SGLangHTTPConfig
from rollout.engines.pool import EnginePool
from rollout.request import validate_trajectory
from rollout.runner import RolloutRunner
from rollout.serve.processes import ServeProcess, start_serve, stop_on_sigterm, stop_servers, wait_healthy
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.base import ToolError, ToolResponse
from tools.calculator import CalculatorTool

FAULTS = ["--fault-error-rate", "0.05", "--fault-hang-rate", "0.02", "--fault-drop-rate", "0.03"]
TIMEOUT_S = 3600.0
"""Deadline of the whole soak (10,000 requests take about 6 minutes)."""
STARTUP_TIMEOUT_S = 90.0
"""Deadline of a server's start (until /health answers)."""


class FlakyCalculator(CalculatorTool):
    """The calculator, failing in every way a tool can, at the given rates (seeded)."""

    def __init__(self, rates: dict[str, float], seed: int = 0, hang_s: float = 5.0):
        super().__init__()
        self.rates, self.hang_s = rates, hang_s
        self.random = random.Random(seed)
        self.created = self.released = self.create_failures = self.release_failures = 0
        self.live: set[str] = set()

    def _roll(self, fault: str) -> bool:
        return self.random.random() < self.rates.get(fault, 0.0)

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        if self._roll("create"):
            self.create_failures += 1
            raise ToolError("create failed (injected)")
        instance_id = await super().create(instance_id, **create_kwargs)
        self.created += 1
        self.live.add(instance_id)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> Any:
        if self._roll("raise"):
            raise RuntimeError("tool crashed (injected)")
        if self._roll("hang"):
            await asyncio.sleep(self.hang_s)
        if self._roll("wrong_type"):
            return {"not": "a ToolResponse"}
        if self._roll("huge"):
            return ToolResponse("x" * 2_000_000)
        return await super().execute(instance_id, parameters, **execute_kwargs)

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        self.released += 1
        self.live.discard(instance_id)
        await super().release(instance_id, **release_kwargs)
        if self._roll("release"):
            self.release_failures += 1
            raise ToolError("release failed (injected)")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def soak(requests: int, servers: list[ServeProcess], out: Path, log_dir: Path, console: Console,
               timeout_s: float = TIMEOUT_S, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> dict:  # fmt: skip
    """The soak on ``servers``; WaitTimeout when the rollout has not ended ``timeout_s`` after it began."""
    tool = FlakyCalculator({"create": 0.01, "raise": 0.03, "hang": 0.01, "wrong_type": 0.02, "huge": 0.02,
                            "release": 0.01}, hang_s=3.0)  # fmt: skip
    chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [tool.schema])
    config = RolloutConfig(max_turns=3, max_new_tokens=96, max_model_len=1024, tool_timeout_s=1.0)
    prompts = requests // 4
    records = make_task("calc", prompts, seed=7)
    client = SGLangHTTPConfig(timeout_s=15.0, max_retries=3, backoff_s=0.05, backoff_max_s=0.5)
    pool_config = PoolConfig(health_interval_s=0.5, client=client)
    async with EnginePool([s.url for s in servers], pool_config) as pool:
        runner = RolloutRunner(pool, chat, {tool.name: tool}, config, max_concurrency=128, progress=True,
                               console=console)  # fmt: skip
        rollout = asyncio.create_task(runner.run(records, 4, out))
        victim, killed, restarted = servers[0], False, False
        started = time.monotonic()
        while not rollout.done():
            await asyncio.sleep(0.5)
            if time.monotonic() - started > timeout_s:
                rollout.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rollout
                done = out.read_bytes().count(b"\n") if out.exists() else 0
                raise WaitTimeout(f"the soak did not finish within {timeout_s:g} s (--timeout-s): {done} of "
                                  f"{prompts * 4} trajectories written")  # fmt: skip
            finished = out.read_bytes().count(b"\n") if out.exists() else 0
            if not killed and finished >= requests // 3:
                await asyncio.to_thread(victim.kill)
                killed = True
                console.print(f"killed {victim.url} after {finished} trajectories")
            elif killed and not restarted and finished >= 2 * requests // 3:
                port = int(victim.url.rsplit(":", 1)[1])
                victim = servers[0] = await asyncio.to_thread(start_serve, EMBEDDED_MODEL, log_dir, port, *FAULTS)
                await asyncio.to_thread(wait_healthy, victim.url, victim.process, victim.log, startup_timeout_s)
                restarted = True
                console.print(f"restarted {victim.url} after {finished} trajectories")
        result = await rollout
        stats = pool.stats()
    wall = time.monotonic() - started
    lines = out.read_bytes().splitlines()
    ids = Counter()
    invalid = 0
    for line in lines:
        record = orjson.loads(line)
        ids[(record["prompt_index"], record["sample_index"])] += 1
        try:
            validate_trajectory(record)
        except ValueError:
            invalid += 1
    reasons = Counter(r.finish_reason.value for r in result.requests)
    return {
        "requests_in": prompts * 4,
        "completed": sum(n for reason, n in reasons.items() if reason != "error"),
        "errored": reasons.get("error", 0),
        "lost": prompts * 4 - len(ids),
        "duplicated": sum(n - 1 for n in ids.values() if n > 1),
        "jsonl_lines": len(lines),
        "invalid_lines": invalid,
        "finish_reasons": dict(reasons),
        "tool_calls_with_errors": sum(r.metrics.tool_errors for r in result.requests),
        "creates": tool.created,
        "releases": tool.released,
        "create_failures": tool.create_failures,
        "release_failures": tool.release_failures,
        "instances_left": len(tool.live),
        "failovers": stats["failovers"],
        "wall_s": wall,
        "peak_rss_mb": peak_rss_mb(),
    }


def soak_failures(figures: dict[str, Any]) -> list[str]:
    """What a soak run got wrong (empty: it passed): trajectories lost or written twice, invalid
    JSONL lines, tool instances created and not released."""
    failures = []
    if figures["lost"]:
        failures.append(f"{figures['lost']} of {figures['requests_in']} requests lost (no trajectory written)")
    if figures["duplicated"]:
        failures.append(f"{figures['duplicated']} trajectories written more than once")
    if figures["invalid_lines"]:
        failures.append(f"{figures['invalid_lines']} JSONL lines are not valid trajectories")
    if figures["creates"] != figures["releases"]:
        failures.append(f"{figures['creates']} tool instances created but {figures['releases']} released")
    if figures["instances_left"]:
        failures.append(f"{figures['instances_left']} tool instances never released")
    return failures


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("soak.jsonl"))
    parser.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="deadline of the whole soak")
    parser.add_argument("--startup-timeout-s", type=float, default=STARTUP_TIMEOUT_S,
                        help="deadline of a server's start")  # fmt: skip
    args = parser.parse_args()
    console = Console(stderr=True)
    log_dir = args.out.resolve().parent
    servers: list[ServeProcess] = []
    try:
        for _ in range(args.servers):
            servers.append(start_serve(EMBEDDED_MODEL, log_dir, None, *FAULTS))
        for server in servers:
            wait_healthy(server.url, server.process, server.log, args.startup_timeout_s)
        figures = asyncio.run(soak(args.requests, servers, args.out, log_dir, console, args.timeout_s,
                                   args.startup_timeout_s))  # fmt: skip
    finally:
        stop_servers(servers, timeout_s=5.0)
    table = Table(title="soak")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key.replace("_", " "), f"{value:.1f}" if isinstance(value, float) else str(value))
    console.print(table)
    failures = soak_failures(figures)
    if failures:
        console.print("[bold red]FAIL[/]: " + "; ".join(failures))
        raise SystemExit(1)
    console.print("[bold green]PASS[/]")


if __name__ == "__main__":
    main()
