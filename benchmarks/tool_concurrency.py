"""Tool-call concurrency: rallyrl against an exact bound, the bare client and a batch-level baseline.

    python -m benchmarks.tool_concurrency [--workload W1|W2|W3|all] [--quick] [--rounds N] [--json F] [--plot F]
    rallyrl bench ...   (the same)

For each workload the systems see the same server model and the same sampled tool
latencies: (a) rallyrl, ``RolloutRunner`` over ``sglang_http`` against the simulated server
(``benchmarks/sim_server.py``, a separate process on the same cores); (b) the bare client
(``benchmarks/bare_client.py``: raw aiohttp, text in and out), the yardstick of client CPU;
(c) the batch-level baseline, a real client; each against a fresh simulated server; (d) the
bound, a discrete-event simulation of the same server with zero client cost
(``benchmarks/bound.py``), for an asynchronous client and for a batch-level one; (e) where uvloop is
installed (``rallyrl[uvloop]``), rallyrl again on uvloop, its CPU ratio to the bare client on asyncio's loop.

Reported: makespan, trajectories/s, efficiency (bound / measured), speedup over the
batch-level baseline, p50 and p99 request latency, engine utilisation (busy slots over
capacity x makespan), client CPU per turn (process CPU / turns, its ratio to the bare
client's in the same run, and the median over 0.25 s windows), peak RSS, and the simulated
server's lateness (how late its steps started). rallyrl and the bare client run ``--rounds``
times, alternately, each against a fresh server; each row is that client's round of median CPU
per turn (client CPU on a shared 2-core machine moves by 20 % from run to run; a ratio of medians
of interleaved rounds moves much less).
A Markdown table, a JSON file and a PNG timeline (requests down, time across, colored by state).
Deadlines: a simulated server that is not ready within ``SERVER_READY_S``, or a client's run that
takes longer than ``--run-timeout-s`` (600 s), ends the benchmark with an error naming it; the
simulated servers are stopped on every way out (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

from benchmarks.bound import BoundResult, asynchronous_bound, batch_level_bound
from benchmarks.clients import ClientRun, run_bare, run_batch_level, run_rallyrl
from benchmarks.sim_server import raise_fd_limit
from benchmarks.waits import finish_within, read_line, stop_process
from benchmarks.workloads import QUICK, WORKLOADS, Scenario, Workload
from data.files import atomic_write_bytes, atomic_write_with
from rollout.event_loop import run as run_on_loop
from rollout.event_loop import uvloop_installed
from rollout.serve.processes import stop_on_sigterm

COLORS = {"running": "#3b76af", "tool": "#ef8636", "user": "#519e3e"}
SERVER_READY_S = 60.0
"""Deadline of a simulated server's start (until it says ``ready``)."""
UVLOOP_ROW = "rallyrl on uvloop"
"""The row of rallyrl on uvloop (where installed); its CPU ratio is to the bare client on asyncio's loop."""
RUN_TIMEOUT_S = 600.0
"""Deadline of one client's run against a simulated server (the full workloads take under a minute)."""


@contextlib.contextmanager
def sim_server(scenario: Scenario) -> Iterator[tuple[str, Any]]:
    """A fresh simulated server process; yields its URL and a function returning its stats."""
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(orjson.dumps(scenario.server_config()))
    command = [sys.executable, "-m", "benchmarks.sim_server", "--config", f.name]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = read_line(process, SERVER_READY_S, "the simulated server's start")
        if not line.startswith("ready "):
            raise RuntimeError(f"the simulated server did not start: {line}{process.stderr.read()}")  # type: ignore[union-attr]
        url = line.split()[1]

        def stats() -> dict[str, Any]:
            with urllib.request.urlopen(f"{url}/sim_stats", timeout=30) as response:
                return orjson.loads(response.read())

        yield url, stats
    finally:
        stop_process(process)
        os.unlink(f.name)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def client_row(name: str, run: ClientRun, bound: BoundResult, baseline_s: float | None, server: dict, w: Workload):
    """A measured client. The median over windows is left out for the batch-level client: its
    turns finish in bursts in windows that did none of their work, so it would mean nothing."""
    windows = run.cpu_per_turn_windows_us if name != "batch-level" else []
    return {
        "system": name,
        "makespan_s": run.makespan_s,
        "trajectories_per_s": w.requests / run.makespan_s,
        "efficiency": bound.makespan_s / run.makespan_s,
        "speedup_over_batch": (baseline_s / run.makespan_s) if baseline_s else None,
        "latency_p50_s": percentile(run.request_latency_s, 50),
        "latency_p99_s": percentile(run.request_latency_s, 99),
        "utilisation": server["busy_slot_s"] / (w.capacity * run.makespan_s),
        "client_cpu_per_turn_us": run.cpu_s / max(run.turns, 1) * 1e6,
        "client_cpu_per_turn_median_us": float(np.median(windows)) if windows else None,
        "client_cpu_s": run.cpu_s,
        "turns": run.turns,
        "peak_rss_mb": run.peak_rss_mb,
        "server_lateness_p50_ms": server["lateness_p50_ms"],
        "server_lateness_p99_ms": server["lateness_p99_ms"],
        "server_lateness_max_ms": server["lateness_max_ms"],
        "server_cpu_s": server["cpu_s"],
        "first_request_after_s": (server["first_arrival"] or run.started) - run.started,
        "done_after_last_answer_s": run.started + run.makespan_s - (server["last_answer"] or run.started),
        "server_steps": server["steps"],
        "finish_reasons": run.finish_reasons,
    }


def bound_row(name: str, bound: BoundResult, baseline_s: float | None, w: Workload) -> dict[str, Any]:
    return {
        "system": name,
        "makespan_s": bound.makespan_s,
        "trajectories_per_s": w.requests / bound.makespan_s,
        "efficiency": 1.0,
        "speedup_over_batch": (baseline_s / bound.makespan_s) if baseline_s else None,
        "latency_p50_s": percentile(bound.request_latency_s, 50),
        "latency_p99_s": percentile(bound.request_latency_s, 99),
        "utilisation": bound.utilisation(w.capacity),
        "server_steps": bound.steps,
    }


def run_workload(workload: Workload, console: Console, rounds: int = 1,
                 run_timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
    """The bound, rallyrl, the bare client and the batch-level baseline on one workload. rallyrl and
    the bare client run ``rounds`` times, alternately (rallyrl, bare, rallyrl, bare, ...), each
    against a fresh server: the row of each is its round of median CPU per turn, and the CPU ratio
    is that of the two medians, so that a slow spell of a shared machine weighs on neither alone."""
    scenario = Scenario.build(workload)
    console.print(f"[bold]{workload.describe()}[/]", highlight=False)
    bound = asynchronous_bound(scenario, keep_segments=True)
    batch_bound = batch_level_bound(scenario)
    one_round = [("rallyrl", run_rallyrl, "asyncio"), ("bare", run_bare, "asyncio")]
    if uvloop_installed():  # rallyrl on uvloop, against the same bare client (on asyncio's loop)
        one_round.append((UVLOOP_ROW, run_rallyrl, "uvloop"))
    order = one_round * rounds + [("batch-level", run_batch_level, "asyncio")]
    measured: dict[str, list[tuple[ClientRun, dict]]] = {name: [] for name, _, _ in order}
    for name, client, loop in order:
        scenario = Scenario.build(workload)  # a fresh tool (its rate limit) for each client
        with sim_server(scenario) as (url, stats):
            started = time.monotonic()
            what = f"{workload.name}: the {name} client's run"
            run = run_on_loop(finish_within(client(scenario, url), run_timeout_s, what, "--run-timeout-s"), loop)
            measured[name].append((run, stats()))
        console.print(
            f"  {name}: {run.makespan_s:.2f} s, {run.cpu_s / max(run.turns, 1) * 1e6:.0f} us CPU per turn "
            f"({time.monotonic() - started:.1f} s)",
            highlight=False,
        )
    runs = {name: _median_round(rounds_of) for name, rounds_of in measured.items()}
    baseline_s = runs["batch-level"][0].makespan_s
    rows = [
        bound_row("bound", bound, batch_bound.makespan_s, workload),
        client_row("rallyrl", runs["rallyrl"][0], bound, baseline_s, runs["rallyrl"][1], workload),
        client_row("bare", runs["bare"][0], bound, baseline_s, runs["bare"][1], workload),
        *([client_row(UVLOOP_ROW, runs[UVLOOP_ROW][0], bound, baseline_s, runs[UVLOOP_ROW][1], workload)]
          if UVLOOP_ROW in runs else []),
        bound_row("batch-level bound", batch_bound, None, workload),
        client_row("batch-level", runs["batch-level"][0], batch_bound, None, runs["batch-level"][1], workload),
    ]  # fmt: skip
    for row in rows:
        if row["system"] in measured and row["system"] != "batch-level":
            row["client_cpu_per_turn_rounds_us"] = [_cpu_per_turn_us(run) for run, _ in measured[row["system"]]]
    bare_cpu = rows[2]["client_cpu_per_turn_us"]
    for row in rows:
        if "client_cpu_per_turn_us" in row:
            row["cpu_per_turn_vs_bare"] = row["client_cpu_per_turn_us"] / bare_cpu
    return {
        "workload": workload.to_dict(),
        "description": workload.describe(),
        "rounds": rounds,
        "bound_speedup_over_batch": batch_bound.makespan_s / bound.makespan_s,
        "rows": rows,
        "timelines": {
            "bound": bound.segments,
            "rallyrl": runs["rallyrl"][0].segments,
            "batch-level": runs["batch-level"][0].segments,
        },
    }


def _cpu_per_turn_us(run: ClientRun) -> float:
    return run.cpu_s / max(run.turns, 1) * 1e6


def _median_round(rounds: list[tuple[ClientRun, dict]]) -> tuple[ClientRun, dict]:
    """The round of median CPU per turn (the lower middle one of an even number)."""
    ordered = sorted(rounds, key=lambda measured: _cpu_per_turn_us(measured[0]))
    return ordered[(len(ordered) - 1) // 2]


def markdown(results: list[dict[str, Any]]) -> str:
    """One table per workload."""
    columns = [
        ("system", "system", "{}"),
        ("makespan_s", "makespan s", "{:.2f}"),
        ("trajectories_per_s", "traj/s", "{:.1f}"),
        ("efficiency", "efficiency", "{:.3f}"),
        ("speedup_over_batch", "speedup vs batch", "{:.2f}x"),
        ("latency_p50_s", "p50 s", "{:.2f}"),
        ("latency_p99_s", "p99 s", "{:.2f}"),
        ("utilisation", "utilisation", "{:.2f}"),
        ("client_cpu_per_turn_us", "CPU/turn us", "{:.0f}"),
        ("cpu_per_turn_vs_bare", "CPU/turn vs bare", "{:.2f}x"),
        ("client_cpu_per_turn_median_us", "median CPU/turn us", "{:.0f}"),
        ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
        ("server_lateness_p99_ms", "server late p99 ms", "{:.2f}"),
        ("server_lateness_max_ms", "server late max ms", "{:.1f}"),
    ]
    out = []
    for result in results:
        out.append(f"### {result['description']}\n")
        out.append("| " + " | ".join(title for _, title, _ in columns) + " |")
        out.append("|" + " --- |" * len(columns))
        for row in result["rows"]:
            cells = []
            for key, _, fmt in columns:
                value = row.get(key)
                cells.append("-" if value is None else fmt.format(value))
            out.append("| " + " | ".join(cells) + " |")
        out.append(f"\nBound speedup over a perfect batch-level client: {result['bound_speedup_over_batch']:.2f}x\n")
    return "\n".join(out)


def rich_table(result: dict[str, Any]) -> Table:
    table = Table(title=result["description"], title_justify="left")
    keys = [
        "makespan_s", "efficiency", "speedup_over_batch", "latency_p50_s", "latency_p99_s", "utilisation",
        "client_cpu_per_turn_us", "cpu_per_turn_vs_bare", "client_cpu_per_turn_median_us", "peak_rss_mb",
        "server_lateness_p99_ms",
    ]  # fmt: skip
    table.add_column("system")
    for key in keys:
        table.add_column(key.replace("_", " "), justify="right")
    for row in result["rows"]:
        cells = []
        for key in keys:
            value = row.get(key)
            cells.append("-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value))
        table.add_row(row["system"], *cells)
    return table


def plot_timelines(results: list[dict[str, Any]], path: Path) -> None:
    """Requests down, time across, one row of panels per workload: the bound, rallyrl and the
    batch-level baseline, on one time axis; blue while generating (queued at the server
    included), orange while its tool call runs, green while an interaction plays the user."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    systems = ["bound", "rallyrl", "batch-level"]
    fig, axes = plt.subplots(len(results), 3, figsize=(15, 3.6 * len(results)), squeeze=False)
    for row, result in enumerate(results):
        longest = max(seg[2] for name in systems for req in result["timelines"][name] for seg in req) or 1.0
        for column, name in enumerate(systems):
            axis = axes[row][column]
            timeline = result["timelines"][name]
            for state, color in COLORS.items():
                lines = [[(s, i), (e, i)] for i, req in enumerate(timeline) for st, s, e in req if st == state]
                width = max(0.2, min(2.0, 300 / max(len(timeline), 1)))
                axis.add_collection(LineCollection(lines, colors=color, linewidths=width))
            axis.set_xlim(0, longest * 1.02)
            axis.set_ylim(len(timeline), 0)
            makespan = next(r["makespan_s"] for r in result["rows"] if r["system"] == name)
            axis.set_title(f"{result['workload']['name']} - {name}: {makespan:.2f} s", fontsize=10)
            axis.set_xlabel("time (s)")
            if column == 0:
                axis.set_ylabel("request")
    labels = {"running": "generating", "tool": "tool call", "user": "user turn (interaction)"}
    shown = {st for result in results for name in systems for req in result["timelines"][name] for st, _, _ in req}
    handles = [Line2D([], [], color=COLORS[s], linewidth=4, label=label) for s, label in labels.items()
               if s in shown or s != "user"]  # fmt: skip
    fig.legend(handles=handles, loc="upper right")
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=90))
    plt.close(fig)


ROUNDS_HELP = (
    "Rounds of rallyrl and the bare client, alternately; the median round of each is reported "
    "(default 3, 1 with --quick)."
)


def default_rounds(quick: bool) -> int:
    return 1 if quick else 3


def workloads_named(names: list[str], quick: bool) -> list[Workload]:
    catalog = QUICK if quick else WORKLOADS
    return [catalog[name] for name in names]


@stop_on_sigterm()
def run_benchmark(
    workloads: list[Workload],
    json_path: Path | None,
    plot_path: Path | None,
    console: Console,
    rounds: int = 1,
    run_timeout_s: float = RUN_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Every workload through the bound and the clients (rallyrl and the bare client ``rounds`` times
    each, alternately); prints the tables, writes JSON and PNG. SIGTERM stops it as Ctrl-C does."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    raise_fd_limit()
    results = [run_workload(workload, console, rounds, run_timeout_s) for workload in workloads]
    for result in results:
        console.print(rich_table(result))
    console.print(markdown(results), highlight=False, markup=False)
    if json_path is not None:
        slim = [{k: v for k, v in r.items() if k != "timelines"} for r in results]
        atomic_write_bytes(json_path, orjson.dumps(slim, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    if plot_path is not None:
        plot_timelines(results, plot_path)
        console.print(f"timeline: {plot_path}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    parser.add_argument("--quick", action="store_true", help="smaller workloads, under a minute in all")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=None, help=ROUNDS_HELP)
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S, help="deadline of each client's run")
    args = parser.parse_args()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    rounds = args.rounds if args.rounds is not None else default_rounds(args.quick)
    run_benchmark(workloads_named(names, args.quick), args.json, args.plot, Console(), rounds, args.run_timeout_s)


if __name__ == "__main__":
    main()
