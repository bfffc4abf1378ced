"""Runs of ``benchmarks/versus_trl.py``: each trainer as a process under a budget of CPU-seconds.

A run is one process (``rallyrl train``, or ``versus_trl_runner.py`` in the TRL virtualenv) watched
from outside: every ``poll_s`` the user+system CPU-seconds of it and its children (the reaped ones
and the live ones) and their peak resident memory (``VmHWM``) are read; each step's line (rallyrl's
``metrics.jsonl``, the runner's ``steps.jsonl``) and each checkpoint directory (``checkpoints/step-N``,
both write them whole) is stamped with the CPU-seconds at which it appeared. Once the process has
used the budget it is killed; the checkpoints stamped within the budget are what gets evaluated.
The same watcher, the same way, for both trainers.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

STEP_DIR = re.compile(r"step-0*(\d+)")


@dataclass
class Checkpoint:
    step: int
    cpu_s: float
    """The process's CPU-seconds at the end of the step that produced it (save excluded)."""
    path: str
    save_cpu_s: float = 0.0
    """CPU-seconds between that step's line and the directory's appearance: the save itself."""


@dataclass
class Run:
    """What one budgeted run did: its steps and checkpoints, stamped with CPU-seconds."""

    trainer: str
    seed: int
    lr: float
    budget_cpu_s: float
    steps: list[dict[str, Any]] = field(default_factory=list)
    """One per finished step: step, cpu_s (at its end), sampled_tokens, reward_mean."""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    cpu_s: float = 0.0
    """CPU-seconds when the process ended or was stopped."""
    peak_rss_bytes: int = 0
    stopped_at_budget: bool = False
    returncode: int | None = None
    log: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "checkpoints": [c.__dict__ for c in self.checkpoints]}


class CpuMeter:
    """CPU-seconds and peak RSS of a process and its children, read from /proc through psutil."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.cpu_s = 0.0
        self.peak_rss_bytes = 0

    def sample(self) -> float:
        """Refresh the figures (they never go down); the CPU-seconds."""
        try:
            times = self.root.cpu_times()
            cpu = times.user + times.system + times.children_user + times.children_system
            peak = peak_rss(self.root.pid)
            for child in self.root.children(recursive=True):
                try:
                    child_times = child.cpu_times()
                    cpu += child_times.user + child_times.system
                    peak += peak_rss(child.pid)
                except psutil.Error:
                    continue  # ended between the listing and the read
        except psutil.Error:
            return self.cpu_s  # the process has ended: keep the last reading
        self.cpu_s = max(self.cpu_s, cpu)
        self.peak_rss_bytes = max(self.peak_rss_bytes, peak)
        return self.cpu_s


def peak_rss(pid: int) -> int:
    """The peak resident set (VmHWM) of a process, in bytes; 0 when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def read_new_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON lines of ``path`` after byte ``offset``, and the offset after them."""
    if not path.exists():
        return [], offset
    with path.open("rb") as file:
        file.seek(offset)
        raw = file.read()
    complete = raw[: raw.rfind(b"\n") + 1]
    return [orjson.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def run_budgeted(
    run: Run,
    command: list[str],
    env: dict[str, str],
    out: Path,
    steps_file: str,
    step_fields: dict[str, str],
    poll_s: float = 0.05,
) -> Run:
    """Run ``command`` until it exits or has used ``run.budget_cpu_s``; fill ``run``.

    ``steps_file`` (under ``out``) gets one JSON line per finished step; ``step_fields`` maps the
    names this benchmark uses (sampled_tokens, reward_mean) to that file's keys.
    """
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "trainer.log"
    run.log = str(log_path)
    step_cpu: dict[int, float] = {}
    seen: set[str] = set()
    offset = 0
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        meter = CpuMeter(process.pid)
        try:
            while True:
                ended = process.poll() is not None
                cpu = meter.sample()
                lines, offset = read_new_lines(out / steps_file, offset)
                for line in lines:
                    step_cpu[int(line["step"])] = cpu
                    run.steps.append(
                        {
                            "step": int(line["step"]),
                            "cpu_s": cpu,
                            **{ours: line.get(theirs) for ours, theirs in step_fields.items()},
                        }
                    )
                for checkpoint in sorted((out / "checkpoints").glob("step-*")):
                    found = STEP_DIR.fullmatch(checkpoint.name)
                    if found and checkpoint.name not in seen:
                        seen.add(checkpoint.name)
                        step = int(found[1])
                        at = step_cpu.get(step, cpu)
                        run.checkpoints.append(Checkpoint(step, at, str(checkpoint), max(0.0, cpu - at)))
                if ended:
                    break
                if cpu >= run.budget_cpu_s:
                    run.stopped_at_budget = True
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    break
                time.sleep(poll_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    run.returncode = process.returncode
    run.cpu_s, run.peak_rss_bytes = meter.cpu_s, meter.peak_rss_bytes
    if not run.stopped_at_budget and run.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{run.trainer} (seed {run.seed}, lr {run.lr}) exited {run.returncode}; {log_path}:\n{tail}")
    return run


def step_costs(run: Run) -> dict[str, float]:
    """CPU per step and per sampled token over the steps after the first (whose interval holds the
    process's start), each step's checkpoint save taken out; NaN with fewer than two steps."""
    saves = {c.step: c.save_cpu_s for c in run.checkpoints}
    per_step, tokens = [], 0.0
    for before, step in zip(run.steps, run.steps[1:], strict=False):
        per_step.append(step["cpu_s"] - before["cpu_s"] - saves.get(before["step"], 0.0))
        tokens += float(step.get("sampled_tokens") or 0.0)
    if not per_step:
        return {"cpu_s_per_step": float("nan"), "cpu_ms_per_sampled_token": float("nan"), "steps_timed": 0}
    total = sum(per_step)
    return {
        "cpu_s_per_step": total / len(per_step),
        "cpu_ms_per_sampled_token": 1000 * total / tokens if tokens else float("nan"),
        "steps_timed": len(per_step),
    }


def eval_points(run: Run, marks: int) -> list[Checkpoint]:
    """For each of ``marks`` evenly spaced CPU-second marks up to the budget, the last checkpoint
    within it (each once): the points of the accuracy curve, the last one "at the budget"."""
    chosen: list[Checkpoint] = []
    for k in range(1, marks + 1):
        mark = run.budget_cpu_s * k / marks
        within = [c for c in run.checkpoints if c.cpu_s <= mark]
        if within and (best := max(within, key=lambda c: c.cpu_s)) not in chosen:
            chosen.append(best)
    return chosen


def prune_checkpoints(run: Run, keep: list[Checkpoint]) -> None:
    """Delete the checkpoints not evaluated (a run writes one every few steps)."""
    kept = {c.path for c in keep}
    for checkpoint in run.checkpoints:
        if checkpoint.path not in kept:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
