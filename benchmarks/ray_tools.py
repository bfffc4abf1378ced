"""Tool calls per second at 256 in flight: in the rollout process, and in Ray actors (``executor: ray``).

    python -m benchmarks.ray_tools [--calls 256] [--in-flight 256] [--nodes 2] [--max-concurrent 4]
                                   [--rounds 1] [--json FILE]

A local Ray cluster of ``--nodes`` nodes (``ray.cluster_utils.Cluster``: all on this machine, each with
one ``bench`` resource, so that two actors land on two nodes; no dashboard) is started. Each row makes
``--calls`` calls with ``--in-flight`` of them open at once, each on an instance of its own (created
before, released after, not timed), after a warm-up call per actor:

- calculator, here / on Ray: a call that costs almost nothing, so the difference is Ray's round trip
  (the proxy, the actor's event loop, two serializations) at that concurrency;
- python, here / on Ray with 1 actor / on Ray with one actor per node: ``print(1)`` in the sandbox,
  ``--max-concurrent`` sandboxes at once in all (per actor: that / actors). Sandbox starts bound it.

Reported: calls/s (min .. max over ``--rounds``), ms per call at that rate (1000 / calls/s) and the
overhead per call against the same tool here (the difference of the ms per call). On one machine the
nodes share its cores, so more actors add no throughput here; on a cluster each node adds its own
(docs/beyond-one-machine.md: what N nodes give).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.serve.processes import stop_on_sigterm

MB = 2**20
PYTHON = {"class_name": "tools.python_sandbox:PythonTool"}
CALCULATOR = {"class_name": "tools.calculator:CalculatorTool"}
ARGUMENTS = {"python": {"code": "print(1)"}, "calculator": {"expression": "12345 * 6789"}}


async def calls_per_s(tool: Any, calls: int, in_flight: int, warm: int) -> float:
    """``calls`` executes, ``in_flight`` at once, each instance created before the clock starts."""
    arguments = ARGUMENTS[tool.name]
    ids = [await tool.create(f"bench-{i}") for i in range(in_flight)]
    for instance in ids[:warm]:  # the pool places new instances on the least loaded actor: one per actor
        await tool.execute(instance, arguments)
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with gate:
            response = await tool.execute(ids[i % in_flight], arguments)
            if response.metrics.get("error"):
                raise RuntimeError(f"{tool.name}: {response.text}")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(calls)))
    elapsed = time.perf_counter() - started
    for instance in ids:
        await tool.release(instance)
    return calls / elapsed


def rows(args: argparse.Namespace, address: str) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(tool, where, actors, entry) of every row."""
    python = {**PYTHON, "config": {"max_concurrent": args.max_concurrent}}
    on_ray = {"address": address, "num_cpus": 0, "resources": {"bench": 1}}
    made = [("calculator", "here", 0, CALCULATOR),
            ("calculator", "ray", 1, {**CALCULATOR, "executor": "ray", "ray": {**on_ray, "actors": 1}}),
            ("python", "here", 0, python),
            ("python", "ray", 1, {**python, "executor": "ray", "ray": {**on_ray, "actors": 1}})]  # fmt: skip
    if args.nodes > 1:
        per_actor = {"max_concurrent": max(1, args.max_concurrent // args.nodes)}
        made.append(("python", "ray", args.nodes, {**python, "config": per_actor, "executor": "ray",
                                                   "ray": {**on_ray, "actors": args.nodes}}))  # fmt: skip
    return made


async def measure(args: argparse.Namespace, address: str) -> list[dict[str, Any]]:
    from tools.registry import build_tools, close_tools

    results = []
    for name, where, actors, entry in rows(args, address):
        tools = build_tools([entry])
        try:
            rates = [await calls_per_s(tools[name], args.calls, args.in_flight, max(actors, 1))
                     for _ in range(args.rounds)]  # fmt: skip
        finally:
            close_tools(tools)
        results.append({"tool": name, "where": where, "actors": actors, "calls_per_s": rates})
        print(f"{name} {where} {actors or ''}: {', '.join(f'{r:.1f}' for r in rates)} calls/s", flush=True)
    return results


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    made = Table(title=f"tool calls at {args.in_flight} in flight ({args.calls} calls, {args.nodes} Ray node(s) on "
                       f"this machine, python: {args.max_concurrent} sandboxes at once in all)")  # fmt: skip
    for column in ("tool", "where", "actors", "calls/s", "ms per call", "overhead per call (ms)"):
        made.add_column(column, justify="left" if column in ("tool", "where") else "right")
    here = {r["tool"]: 1000 / max(r["calls_per_s"]) for r in results if r["where"] == "here"}
    for r in results:
        low, high = min(r["calls_per_s"]), max(r["calls_per_s"])
        ms = 1000 / high
        overhead = "-" if r["where"] == "here" else f"{ms - here[r['tool']]:.2f}"
        rate = f"{low:.1f}" if low == high else f"{low:.1f} .. {high:.1f}"
        made.add_row(r["tool"], r["where"], str(r["actors"] or "-"), rate, f"{ms:.2f}", overhead)
    return made


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes of the local cluster (1 or more)")
    parser.add_argument("--max-concurrent", type=int, default=4, help="python sandboxes at once, in all")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    from tools import ray_cluster

    node = {"num_cpus": 2, "object_store_memory": 80 * MB, "resources": {"bench": 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        results = asyncio.run(measure(args, cluster.address))
    finally:
        ray_cluster.shutdown()
        cluster.shutdown()
    Console().print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
