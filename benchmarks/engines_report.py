"""``benchmarks/engines.py``'s runs and their report: each engine's timed runs (``Row``, ``Run``), the
results table (median and spread over the repeats) and the breakdown of one engine's calls (time kept
at the client and at the server, CPU by process)."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.engine_clients import CallProfile, CpuUse


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@dataclass
class Run:
    """One timed run of one client."""

    client: str  # "rallyrl" | "raw"
    repeat: int
    wall_s: float
    output_tokens: int
    calls: int
    cpu: CpuUse
    profile: CallProfile
    errors: int = 0
    replays: int | None = None
    """For a raw run: the repeat whose rallyrl calls it replayed."""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Row:
    """One engine's runs, or why it was skipped."""

    engine: str
    startup_s: float | None = None
    runs: list[Run] = field(default_factory=list)
    skipped: str | None = None
    cprofile: str | None = None
    console: Console | None = field(default=None, repr=False)
    """Where each run is noted as it ends (None: nowhere)."""

    def add(self, run: Run) -> None:
        self.runs.append(run)
        if self.console is not None:
            p, cpu = run.profile, run.cpu
            self.console.print(
                f"  {self.engine} {run.client:7} repeat {run.repeat}: {run.wall_s:6.1f} s, {run.tokens_per_s:7,.0f} "
                f"tokens/s, {p.in_flight:4.1f} calls in flight, latency {p.latency_s:5.2f} s; CPU s: client "
                f"{cpu.client_s:.1f}, server {seconds(cpu.server_s)}, others {seconds(cpu.others_s)}"
                + (f"; {run.errors} errors" if run.errors else ""),
                highlight=False,
            )

    def of(self, client: str) -> list[Run]:
        return [run for run in self.runs if run.client == client]

    def ratios(self) -> list[float]:
        """rallyrl/raw tokens/s of each repeat's pair."""
        raw = {run.repeat: run for run in self.of("raw")}
        return [run.tokens_per_s / raw[run.repeat].tokens_per_s for run in self.of("rallyrl") if run.repeat in raw]

    def to_dict(self) -> dict[str, Any]:
        runs = [asdict(run) | {"tokens_per_s": run.tokens_per_s} for run in self.runs]
        return {"engine": self.engine, "startup_s": self.startup_s, "skipped": self.skipped, "runs": runs,
                "ratios": self.ratios()}  # fmt: skip


def cores(run: Run, value: float | None) -> float:
    """CPU seconds of a run as cores busy on average (0 where unknown)."""
    return (value or 0.0) / run.wall_s if run.wall_s > 0 else 0.0


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    median = format(statistics.median(values), fmt)
    return median if len(values) == 1 else f"{median} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def results_table(rows: list[Row]) -> Table:
    table = Table(title="calc rollout, same workload on each engine (median, range over repeats)")
    for column in ("engine", "client", "start-up s", "runs", "calls", "output tokens", "wall s", "tokens/s",
                   "client CPU s", "others' cores", "rallyrl / raw"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("engine", "client") else "right")
    for row in rows:
        if row.skipped:
            table.add_row(row.engine, "skipped", *["-"] * 9)
            continue
        for client in ("rallyrl", "raw"):
            runs = row.of(client)
            if not runs:
                continue
            ratio = spread(row.ratios(), ".3f") if client == "rallyrl" and row.of("raw") else ""
            startup = f"{row.startup_s:.1f}" if client == "rallyrl" and row.startup_s is not None else ""
            table.add_row(
                row.engine if client == "rallyrl" else "", client, startup, str(len(runs)),
                str(runs[0].calls), f"{runs[0].output_tokens:,}", spread([r.wall_s for r in runs], ".1f"),
                spread([r.tokens_per_s for r in runs], ",.0f"), spread([r.cpu.client_s for r in runs], ".1f"),
                spread([cores(r, r.cpu.others_s) for r in runs], ".2f"), ratio,
            )  # fmt: skip
    return table


def breakdown(row: Row, concurrency: int) -> tuple[Table, str]:
    """Where rallyrl's tokens/s went against raw's on one server, medians over repeats."""

    def med(client: str, value: Any) -> float:
        return statistics.median(value(run) for run in row.of(client))

    table = Table(title=f"{row.engine}: rallyrl vs raw, where the time goes (medians)")
    for column in ("measure", "rallyrl", "raw", "rallyrl / raw"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    measures = [
        ("output tokens/s", lambda r: r.tokens_per_s, ",.0f"),
        (f"calls in flight (of {concurrency})", lambda r: r.profile.in_flight, ".1f"),
        ("tokens per call-second", lambda r: r.profile.tokens_per_call_s, ".1f"),
        ("call latency ms", lambda r: 1000 * r.profile.latency_s, ".0f"),
        ("gap between a request's calls ms", lambda r: 1000 * r.profile.gap_s, ".1f"),
        ("client CPU s", lambda r: r.cpu.client_s, ".1f"),
        ("client CPU, cores", lambda r: cores(r, r.cpu.client_s), ".2f"),
        ("server CPU, cores", lambda r: cores(r, r.cpu.server_s), ".2f"),
        ("other processes' CPU, cores", lambda r: cores(r, r.cpu.others_s), ".2f"),
    ]
    if all(run.profile.cached_share is not None for run in row.runs) and any(r.profile.cached_share for r in row.runs):
        measures.append(("prompt tokens cached %", lambda r: 100 * r.profile.cached_share, ".0f"))
    if all(run.profile.outside_server_s is not None for run in row.runs):
        measures.append(("call latency outside the server ms", lambda r: 1000 * r.profile.outside_server_s, ".1f"))
    for name, value, fmt in measures:
        ours, theirs = med("rallyrl", value), med("raw", value)
        quotient = f"{ours / theirs:.3f}" if theirs else "-"
        table.add_row(name, format(ours, fmt), format(theirs, fmt), quotient)
    in_flight = med("rallyrl", lambda r: r.profile.in_flight) / med("raw", lambda r: r.profile.in_flight)
    speed = med("rallyrl", lambda r: r.profile.tokens_per_call_s) / med("raw", lambda r: r.profile.tokens_per_call_s)
    client = med("rallyrl", lambda r: cores(r, r.cpu.client_s)) - med("raw", lambda r: cores(r, r.cpu.client_s))
    others = [med(name, lambda r: cores(r, r.cpu.others_s)) for name in ("rallyrl", "raw")]
    text = (
        f"{row.engine}: rallyrl/raw {statistics.median(row.ratios()):.3f} ~ {in_flight:.3f} (calls kept at the server: "
        f"the rest of the time its requests were between calls: tools, parsing, rendering, scoring) x {speed:.3f} "
        f"(the server's speed per call: rallyrl's client used {client:+.2f} cores more than raw's, and other "
        f"processes {others[0]:.2f} cores during rallyrl's runs, {others[1]:.2f} during raw's, on a machine of "
        f"{os.cpu_count()} shared with the server)."
    )
    raw_rates = [run.tokens_per_s for run in row.of("raw")]
    if len(raw_rates) > 1:
        noise = (max(raw_rates) - min(raw_rates)) / statistics.median(raw_rates)
        text += f" The raw client's own tokens/s spread over {noise:.0%} of its median across repeats: the noise floor."
    return table, text
