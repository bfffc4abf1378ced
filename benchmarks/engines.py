"""The same calc rollout through every engine on this machine, and rallyrl's share of what a raw
client gets out of each server.

    python -m benchmarks.engines [--quick] [--engines embedded,serve,sglang,vllm] [--repeats N] [--json FILE]

Workload: calc prompts (``make_task("calc", prompts, seed)``) x ``samples_per_prompt``, rallyrl's
full multi-turn rollout (calculator tool, up to 3 turns, temperature 1) with 64 requests in
flight. Up to 96 new tokens per turn, not 64: the embedded model's tokenizer is character-level
and a calculator call with its ``<|im_end|>`` takes 66-80 tokens, so at 64 every call is cut
off and no rollout reaches a second turn (``--max-new-tokens 64`` runs that single-turn case).
Per-turn sampling seeds are off (SGLang honours them only in its deterministic mode); the
prompts and the embedded engine's sampler are seeded.

Rows:

- ``embedded``: the embedded engine in this process (no server, so no raw row).
- ``serve``: ``rallyrl serve`` in a subprocess, with ``--threads`` = this machine's cores.
- ``sglang``, ``vllm``: the real engines from their virtualenvs (``rollout/engines/launch.py``);
  a missing virtualenv skips its row with the command that installs it.

On each server: an untimed warm-up (a rallyrl run of one full set of 64 requests and a raw replay
of it: the server's first batches of new shapes are slow), then ``--repeats`` pairs of one rallyrl
run and one raw run. The raw client (``benchmarks/engine_clients.py``) replays the generation calls of
rallyrl's latest run: every turn's input token ids (``prompt_ids + response_ids`` before the turn)
with ``max_new_tokens`` = the tokens rallyrl got in that turn and EOS ignored, each trajectory's
calls one after another with nothing in between, 64 trajectories in flight. So both clients ask
for the same prefill and decode; the raw one has no tools, chat template, parser or checks. A
turn's input holds rallyrl's own earlier output, which the raw client did not generate, so its
later turns find up to one turn's output fewer tokens in the prefix cache: if anything, the raw
client is at a slight disadvantage. The order alternates (rallyrl first in even pairs, raw first
in odd ones) and the server's prefix cache is flushed before every run. The rallyrl run writes
its JSONL like any rollout; its wall time is ``RolloutRunner.run`` from first request to last line.

Reported per row: output tokens/s (median and range over repeats), the CPU seconds of this
(client) process, the cores other processes kept busy meanwhile (``/proc``: the machine's busy
time less the client's and the server's process group's), each server's start-up time, and
rallyrl/raw per pair; each run is also printed as it ends. Where rallyrl is under
``--target`` (0.95) of raw on a server, or with ``--profile``, a breakdown follows: by Little's
law tokens/s = calls in flight x tokens per call-second, so the ratio splits into how many calls
rallyrl kept at the server (what its requests did between calls: tools, parsing, rendering) and
how fast the server served each call (the client's CPU competes with the server's for this
machine's cores; prefix-cache reuse). ``--cprofile`` adds the client's hottest functions during
the rallyrl runs (cProfile slows the client: take the headline figures without it).

The machine's load average is printed at the start and the end, with the busiest processes at
the start: on a shared 2-core machine other work changes every figure.

Deadlines: a server that does not answer ``/health`` within ``--startup-timeout-s`` (240), or a run
(the warm-up, a timed run, a cache flush) that does not finish within ``--run-timeout-s`` (900), ends
its row, with the reason, and the benchmark goes on with the next engine. The servers are stopped
(their whole process groups) on every way out: an error, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import os
import pstats
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from benchmarks.engine_clients import (
    Call,
    CallProfile,
    CpuMeter,
    Protocol,
    RawClient,
    TimedEngine,
    replay_calls,
)
from benchmarks.engines_report import Row, Run, breakdown, results_table
from benchmarks.waits import WaitTimeout, finish_within
from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.api import open_engine
from rollout.config import RolloutConfig
from rollout.engines.config import EngineConfig
from rollout.engines.launch import READY_TIMEOUT_S, EngineNotInstalled, engine_server
from rollout.runner import RolloutRunner
from rollout.serve.processes import serve_processes, stop_on_sigterm
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.registry import DEFAULT_TOOLS, build_tools

ENGINES = ("embedded", "serve", "sglang", "vllm")
RUN_TIMEOUT_S = 900.0
"""Deadline of each run (warm-up, timed run, cache flush): a server that stopped answering ends its row."""


@dataclass(frozen=True)
class Workload:
    """What each run rolls out."""

    prompts: int = 128
    samples_per_prompt: int = 2
    concurrency: int = 64
    max_new_tokens: int = 96
    max_turns: int = 3
    seed: int = 0
    warmup_prompts: int | None = None
    """Prompts of the untimed warm-up run (None: one full set of ``concurrency`` requests in flight)."""

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(max_turns=self.max_turns, max_new_tokens=self.max_new_tokens, temperature=1.0,
                             max_concurrency=self.concurrency)  # fmt: skip


QUICK = Workload(prompts=32)


class Rollouts:
    """rallyrl's side of a row: the runner's parts, built once, and timed runs on one engine."""

    def __init__(self, work: Workload, out_dir: Path, meter: CpuMeter | None = None):
        self.work, self.out_dir, self.meter = work, out_dir, meter or CpuMeter()
        self.tools = build_tools(DEFAULT_TOOLS)
        self.chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [tool.schema for tool in self.tools.values()])
        self.records = make_task("calc", work.prompts, seed=work.seed)
        warmup = work.warmup_prompts or -(-work.concurrency // work.samples_per_prompt)
        self.warmup_records = make_task("calc", warmup, seed=work.seed + 1)
        self.chains: list[list[Call]] = []  # the calls of the latest run, to replay
        self.profiler: cProfile.Profile | None = None

    async def run(self, engine: Any, repeat: int, warmup: bool = False) -> Run:
        timed = TimedEngine(engine)
        runner = RolloutRunner(timed, self.chat, self.tools, self.work.rollout_config(),
                               max_concurrency=self.work.concurrency, progress=False)  # fmt: skip
        records = self.warmup_records if warmup else self.records
        if self.profiler is not None and not warmup:
            self.profiler.enable()
        cpu, start = self.meter.read(), time.perf_counter()
        result = await runner.run(records, self.work.samples_per_prompt, self.out_dir / "rollout.jsonl")
        wall, cpu = time.perf_counter() - start, self.meter.since(cpu)
        if self.profiler is not None:
            self.profiler.disable()
        self.chains = [replay_calls(r.prompt_ids, r.response_ids, r.loss_mask) for r in result.requests]
        errors = sum(r.finish_reason.value == "error" for r in result.requests)
        tokens = sum(r.metrics.generated_tokens for r in result.requests)
        return Run("rallyrl", repeat, wall, tokens, len(timed.calls), cpu, CallProfile.of(timed.calls, wall), errors)


async def raw_run(raw: RawClient, rollouts: Rollouts, repeat: int, replays: int) -> Run:
    cpu, start = rollouts.meter.read(), time.perf_counter()
    calls = await raw.replay(rollouts.chains, rollouts.work.concurrency)
    wall, cpu = time.perf_counter() - start, rollouts.meter.since(cpu)
    tokens = sum(call.output_tokens for call in calls)
    return Run("raw", repeat, wall, tokens, len(calls), cpu, CallProfile.of(calls, wall), replays=replays)


async def bench_server(row: Row, url: str, protocol: Protocol, work: Workload, repeats: int, out_dir: Path,
                       profile: bool = False, server_pgid: int | None = None,
                       run_timeout_s: float = RUN_TIMEOUT_S) -> Row:  # fmt: skip
    """Warm up, then ``repeats`` pairs of a rallyrl run and a raw replay of it on the server at ``url``
    (whose processes are the group ``server_pgid``, when known); WaitTimeout when one of them (or a
    cache flush) takes longer than ``run_timeout_s``."""
    rollouts = Rollouts(work, out_dir, CpuMeter(server_pgid))

    async def within(awaitable: Any, what: str) -> Any:
        return await finish_within(awaitable, run_timeout_s, f"{row.engine} at {url}: {what}", "--run-timeout-s")

    async with open_engine(EngineConfig(urls=[url], server=protocol), EMBEDDED_MODEL) as engine, \
            RawClient(url, protocol) as raw:  # fmt: skip
        # new batch shapes, connections: paid here, untimed
        await within(rollouts.run(engine, -1, warmup=True), "the rallyrl warm-up run")
        await within(raw_run(raw, rollouts, -1, -1), "the raw warm-up run")
        rollouts.profiler = cProfile.Profile() if profile else None
        latest = -1
        for repeat in range(repeats):
            for client in ("rallyrl", "raw") if repeat % 2 == 0 else ("raw", "rallyrl"):
                await within(raw.flush_cache(), "flushing the prefix cache")
                if client == "rallyrl":
                    row.add(await within(rollouts.run(engine, repeat), f"rallyrl run {repeat}"))
                    latest = repeat
                else:
                    row.add(await within(raw_run(raw, rollouts, repeat, latest), f"raw run {repeat}"))
    row.cprofile = hottest(rollouts.profiler) if rollouts.profiler is not None else None
    return row


async def bench_embedded(row: Row, work: Workload, repeats: int, out_dir: Path, profile: bool = False,
                         run_timeout_s: float = RUN_TIMEOUT_S) -> Row:  # fmt: skip
    rollouts = Rollouts(work, out_dir)
    max_model_len = work.rollout_config().max_model_len
    start = time.perf_counter()
    async with open_engine(EngineConfig(), EMBEDDED_MODEL, max_model_len=max_model_len, seed=work.seed) as engine:
        row.startup_s = time.perf_counter() - start
        await finish_within(rollouts.run(engine, -1, warmup=True), run_timeout_s, "embedded: the warm-up run",
                            "--run-timeout-s")  # fmt: skip
        rollouts.profiler = cProfile.Profile() if profile else None
        for repeat in range(repeats):
            await engine.flush_cache()
            run = rollouts.run(engine, repeat)
            row.add(await finish_within(run, run_timeout_s, f"embedded: rallyrl run {repeat}", "--run-timeout-s"))
    row.cprofile = hottest(rollouts.profiler) if rollouts.profiler is not None else None
    return row


def bench_row(engine: str, work: Workload, repeats: int, log_dir: Path, cprofile: bool = False,
              console: Console | None = None, startup_timeout_s: float = READY_TIMEOUT_S,
              run_timeout_s: float = RUN_TIMEOUT_S) -> Row:  # fmt: skip
    """One engine's row; a server that is not installed or does not start skips it, and a run past its
    deadline ends it, saying why (the server is stopped either way)."""
    row = Row(engine, console=console)
    try:
        if engine == "embedded":
            return asyncio.run(bench_embedded(row, work, repeats, log_dir, cprofile, run_timeout_s))
        with contextlib.ExitStack() as stack:
            start = time.perf_counter()
            try:
                if engine == "serve":
                    flags = ("--threads", str(os.cpu_count() or 1))
                    (server,) = stack.enter_context(serve_processes(EMBEDDED_MODEL, log_dir, 1, *flags,
                                                                    ready_timeout_s=startup_timeout_s))  # fmt: skip
                else:
                    server = stack.enter_context(engine_server(engine, EMBEDDED_MODEL, log_dir,  # type: ignore[arg-type]
                                                               ready_timeout_s=startup_timeout_s))  # fmt: skip
            except EngineNotInstalled as exc:
                row.skipped = str(exc)
                return row
            except RuntimeError as exc:  # it exited or never became healthy: the message holds its log's end
                row.skipped = f"{engine} did not start (--startup-timeout-s {startup_timeout_s:g}): {str(exc)[-1500:]}"
                return row
            row.startup_s = time.perf_counter() - start
            protocol: Protocol = "vllm" if engine == "vllm" else "sglang"
            pgid = server.process.pid  # started in a session of its own
            return asyncio.run(bench_server(row, server.url, protocol, work, repeats, log_dir, cprofile, pgid,
                                            run_timeout_s))  # fmt: skip
    except WaitTimeout as exc:
        row.skipped = f"{exc}; the runs before it are kept in the JSON"
        return row
    raise AssertionError("unreachable")


def hottest(profiler: cProfile.Profile, count: int = 15) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(count)
    return out.getvalue()


def machine_state() -> dict[str, Any]:
    """Load average and the busiest processes, to read the figures against."""
    busiest = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        busiest = subprocess.run(["ps", "-eo", "pcpu,pid,etime,args", "--sort=-pcpu", "--cols", "110"],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    return {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "busiest": busiest.splitlines()[:8]}


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.prompts} prompts instead of {Workload.prompts}")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of " + ", ".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=3, help="rallyrl/raw pairs per server (order alternates)")
    parser.add_argument("--prompts", type=int, help="calc prompts per run (x samples-per-prompt trajectories)")
    parser.add_argument("--samples-per-prompt", type=int, default=Workload.samples_per_prompt)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=Workload.max_new_tokens,
        help="per turn; under ~80 no calculator call fits, and no rollout gets past its first turn",
    )
    parser.add_argument("--target", type=float, default=0.95, help="rallyrl/raw under this prints the breakdown")
    parser.add_argument("--profile", action="store_true", help="print the breakdown on every server")
    parser.add_argument("--cprofile", action="store_true", help="also the client's hottest functions (slows it)")
    parser.add_argument("--log-dir", type=Path, help="servers' logs and rollout JSONL (default: a temp directory)")
    parser.add_argument("--startup-timeout-s", type=float, default=READY_TIMEOUT_S,
                        help="deadline of a server's start (until /health answers)")  # fmt: skip
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S,
                        help="deadline of each run (warm-up, timed run, cache flush) on a server")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    if unknown := [name for name in engines if name not in ENGINES]:
        parser.error(f"--engines: unknown {', '.join(unknown)} (known: {', '.join(ENGINES)})")
    base = QUICK if args.quick else Workload()
    work = Workload(prompts=args.prompts or base.prompts, samples_per_prompt=args.samples_per_prompt,
                    max_new_tokens=args.max_new_tokens)  # fmt: skip
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rallyrl-bench-engines-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    console = Console(width=150)
    before = machine_state()
    console.print(
        f"{work.prompts} calc prompts x {work.samples_per_prompt} samples, {work.concurrency} in flight, "
        f"{work.max_new_tokens} new tokens per turn, up to {work.max_turns} turns; {args.repeats} repeat(s); "
        f"logs in {log_dir}\nload average at start {before['loadavg']} on {before['cpus']} cores; busiest:",
        highlight=False,
    )
    console.print("\n".join("  " + line for line in before["busiest"]), highlight=False, markup=False)
    rows = []
    for engine in engines:
        console.print(f"[bold]{engine}[/] ...")
        row = bench_row(engine, work, args.repeats, log_dir, args.cprofile, console, args.startup_timeout_s,
                        args.run_timeout_s)  # fmt: skip
        if row.skipped:
            console.print(f"[yellow]{engine} skipped:[/] {row.skipped}", highlight=False)
        elif any(run.errors for run in row.runs):
            console.print(f"[red]{engine}: {sum(r.errors for r in row.runs)} trajectories ended in error[/]")
        rows.append(row)
    after = machine_state()
    console.print(results_table(rows))
    for row in rows:
        if row.of("raw") and (args.profile or min(row.ratios()) < args.target):
            table, text = breakdown(row, work.concurrency)
            console.print(table)
            console.print(text, highlight=False)
        if row.cprofile:
            console.print(f"[bold]{row.engine}: client's hottest functions during the rallyrl runs[/]")
            console.print(row.cprofile, highlight=False, markup=False)
    console.print(f"load average at end {after['loadavg']}", highlight=False)
    if args.json:
        report = {"workload": asdict(work), "repeats": args.repeats, "machine_start": before, "machine_end": after,
                  "rows": [row.to_dict() for row in rows]}  # fmt: skip
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
