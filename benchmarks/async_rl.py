"""Synchronous vs asynchronous GRPO on the same seed and budget (issue 15's benchmark).

Wall time, idle time of engine and trainer, staleness, and held-out accuracy against wall time.

    python -m benchmarks.async_rl [--steps N] [--workloads a,b] [--modes sync,async] [--max-staleness K]
        [--eval-prompts 200] [--checkpoint-every 5] [--seed 1] [--set KEY=VALUE ...]
        [--out out/async_rl] [--plot FILE] [--json FILE]

Workloads:

- ``a``: ``rallyrl train``'s defaults (``GRPOConfig``: the embedded model on the calc task).
- ``b``: the same with the calculator behind a slow tool: every call first waits a lognormal
  latency, median 0.3 s, sigma 1 (p99 about 3 s), seeded per (request, call)
  (``benchmarks/slow_tools.py``), so both modes wait on the same draws.

Modes: ``sync`` (``async_rl: false``: each step rolls out, then updates, then syncs the engine)
and ``async`` (``async_rl: true`` with ``max_staleness``, ``trainer/async_rl.py``).

How: each (workload, mode) is one ``rallyrl train --config FILE`` subprocess of this process,
one after another, never two at once (the machine has few cores, and every figure is wall
time). The runs of a workload differ only in ``async_rl``: the same seed, steps, prompts and
every other setting (``--set`` goes to all of them; each run's ``train.yaml`` reproduces it).
Checkpoints are saved every ``--checkpoint-every`` steps and all kept. After each run this
process evaluates every checkpoint, and the initial model as the point at wall time 0 (once,
shared by all runs): greedy accuracy on ``--eval-prompts`` held-out calc prompts (seed 12345,
``rallyrl eval``'s held-out set; its sampled pass@k pass is skipped), on the embedded engine with
the plain calculator (the slow tool's answers are the calculator's, and evaluation is not timed).

Per run, from its ``metrics.jsonl`` (one line per step):

- ``wall_s``: ``time/elapsed_s`` of the last step, the trainer's own clock of training: start-up,
  model loading and the final save are left out (``process_wall_s`` has them). Wall per step:
  ``wall_s / steps``. ``wall_observed_s`` checks it from outside: the time the last step's
  metrics line appeared (the file is polled every 0.1 s), counted from the first step's start
  (its line's arrival less its ``time/step_wall_s``). It holds what the trainer does between
  steps too, checkpoint saves above all, which an asynchronous trainer's rollouts may go on
  through; a warning is printed where the two differ by more than 3 % (and 1 s).
- ``engine_idle_fraction``, ``trainer_idle_fraction``: the run's share of wall time with no
  generation in flight at the engine, and with the trainer neither updating nor syncing: each
  step's ``time/engine_idle_fraction`` and ``time/trainer_idle_fraction`` weighted by its wall.
- ``staleness_mean``, ``staleness_max``: policy version minus the version that produced each
  token: each step's ``rollout/staleness_mean`` weighted by its ``rollout/generated_tokens``
  (token-weighted over the run), and the largest ``rollout/staleness_max``.
- ``dropped``: groups regenerated for being too stale, the sum of ``rollout/dropped``.
- ``final_accuracy``: held-out greedy accuracy of the last checkpoint; ``final_accuracy_stderr``
  is its binomial standard error sqrt(p (1 - p) / n), the noise to read differences against.
- ``time_to_sync_final_accuracy_s``: the wall time of the first evaluated point (the initial
  model included) whose accuracy reaches the synchronous run's final accuracy on the same
  workload; None if none does. Its resolution is ``--checkpoint-every`` steps.

Trainers older than the ``time/`` keys above: the elapsed time falls back to the sum of
``time/step_wall_s``, and in sync mode only to the sum of ``time/rollout_s + time/update_s +
time/sync_s`` (its phases run one after another; the async phases overlap, so there it stays
missing); in sync mode the trainer's idle share falls back to ``1 - (update + sync) / step wall``
and ``dropped`` to 0. The engine's idle share has no fallback: waits on tools inside the rollout
phase are invisible in the phase times. Each run's ``elapsed_source`` says which was used.

The machine's load average is printed at the start and the end, with the busiest processes
at the start: on a shared machine other work changes every wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.engines import machine_state
from data.config_tree import ConfigError, build, merge_dotted, parse_set
from data.files import atomic_write_bytes, atomic_write_with
from trainer.config import EvalConfig, GRPOConfig

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "a": "calc task, rallyrl train defaults",
    "b": "calc task, calculator behind a lognormal latency (median 0.3 s, sigma 1)",
}
MODES = ("sync", "async")
SLOW_TOOL = {"median_s": 0.3, "sigma": 1.0}
"""Workload b's latency model of each calculator call."""
EVAL_SEED = EvalConfig.seed
"""``rallyrl eval``'s held-out prompts (12345), apart from every training seed."""
CONTROLLED = ("out", "steps", "seed", "async_rl", "max_staleness", "checkpoint_every", "keep_checkpoints", "progress")
"""Fields the benchmark sets itself: ``--set`` may not change them (use the flags)."""
REQUIRED_KEYS = (
    "wall_s",
    "steps",
    "final_accuracy",
    "time_to_sync_final_accuracy_s",
    "staleness_mean",
    "staleness_max",
    "dropped",
    "engine_idle_fraction",
    "trainer_idle_fraction",
)
"""What ``--json`` holds for every workload and mode (besides the extras)."""


# ----- figures from metrics lines (pure) ---------------------------------------------------------


def _number(value: Any) -> float | None:
    """A metric as a float; None for a missing, null or NaN value."""
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _column(lines: list[dict[str, Any]], key: str) -> list[float] | None:
    """``key`` of every line, or None if any line lacks it."""
    values = [_number(line.get(key)) for line in lines]
    return None if not lines or any(v is None for v in values) else values  # type: ignore[return-value]


def elapsed_times(lines: list[dict[str, Any]], mode: str) -> tuple[list[float] | None, str]:
    """Wall seconds since training began at the end of each step, and where they came from:
    ``time/elapsed_s``; else the sum of ``time/step_wall_s``; else, in sync mode only, the sum
    of the phases (they run one after another there). None with ``"missing"`` otherwise."""
    if (elapsed := _column(lines, "time/elapsed_s")) is not None:
        return elapsed, "time/elapsed_s"
    if (walls := _column(lines, "time/step_wall_s")) is not None:
        return list(accumulate(walls)), "time/step_wall_s"
    rollout, update = _column(lines, "time/rollout_s"), _column(lines, "time/update_s")
    if mode == "sync" and rollout is not None and update is not None:
        sync = _column(lines, "time/sync_s") or [0.0] * len(lines)
        return list(accumulate(r + u + s for r, u, s in zip(rollout, update, sync, strict=True))), "phase sum"
    return None, "missing"


def step_walls(lines: list[dict[str, Any]], elapsed: list[float] | None) -> list[float] | None:
    """Each step's wall: ``time/step_wall_s``, else the differences of the elapsed times."""
    if (walls := _column(lines, "time/step_wall_s")) is not None:
        return walls
    if elapsed is None:
        return None
    return [t - before for t, before in zip(elapsed, [0.0, *elapsed[:-1]], strict=True)]


def wall_weighted(values: list[float] | None, walls: list[float] | None) -> float | None:
    """The mean of per-step shares weighted by each step's wall: the run's share."""
    if values is None or walls is None or sum(walls) <= 0:
        return None
    return sum(v * w for v, w in zip(values, walls, strict=True)) / sum(walls)


def idle_fractions(lines: list[dict[str, Any]], mode: str, walls: list[float] | None) -> tuple[float | None, ...]:
    """The run's engine and trainer idle shares (see the module docstring for the sync fallback)."""
    engine = wall_weighted(_column(lines, "time/engine_idle_fraction"), walls)
    trainer_shares = _column(lines, "time/trainer_idle_fraction")
    if trainer_shares is None and mode == "sync" and walls is not None:
        update = _column(lines, "time/update_s")
        sync = _column(lines, "time/sync_s") or [0.0] * len(lines)
        if update is not None:
            trainer_shares = [min(max(1.0 - (u + s) / w, 0.0), 1.0) if w > 0 else 0.0
                              for u, s, w in zip(update, sync, walls, strict=True)]  # fmt: skip
    return engine, wall_weighted(trainer_shares, walls)


def token_weighted_staleness(lines: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    """Mean staleness over every token of the run (each step's mean weighted by its generated
    tokens; by 1 per step where a line lacks them), and the largest of any step."""
    means = [(_number(m.get("rollout/staleness_mean")), _number(m.get("rollout/generated_tokens"))) for m in lines]
    means = [(value, 1.0 if tokens is None else tokens) for value, tokens in means if value is not None]
    maxima = [v for m in lines if (v := _number(m.get("rollout/staleness_max"))) is not None]
    weight = sum(tokens for _, tokens in means)
    mean = sum(value * tokens for value, tokens in means) / weight if weight > 0 else (0.0 if means else None)
    return mean, int(max(maxima)) if maxima else None


def dropped_groups(lines: list[dict[str, Any]], mode: str) -> int | None:
    """Groups regenerated for staleness over the run; a sync run without the key drops none."""
    values = [v for m in lines if (v := _number(m.get("rollout/dropped"))) is not None]
    if not values:
        return 0 if mode == "sync" and lines else None
    return int(sum(values))


def time_to_accuracy(curve: list[dict[str, Any]], target: float | None) -> float | None:
    """The elapsed time of the first point (in step order) whose accuracy reaches ``target``."""
    if target is None:
        return None
    for point in sorted(curve, key=lambda p: p["step"]):
        accuracy, elapsed = _number(point.get("accuracy")), _number(point.get("elapsed_s"))
        if accuracy is not None and elapsed is not None and accuracy >= target - 1e-9:
            return elapsed
    return None


def observed_elapsed(lines: list[dict[str, Any]], arrivals: dict[int, float],
                     walls: list[float] | None) -> list[float] | None:  # fmt: skip
    """The trainer-independent clock: when each step's line appeared, counted from the first
    step's start (its line's arrival less its wall). Unlike ``time/elapsed_s`` it holds whatever
    the trainer did between steps (checkpoint saves, logging)."""
    if not lines or walls is None or any(int(m["step"]) not in arrivals for m in lines):
        return None
    origin = arrivals[int(lines[0]["step"])] - walls[0]
    return [arrivals[int(m["step"])] - origin for m in lines]


CPU_PHASES = ("time/rollout_cpu_s", "time/wait_cpu_s", "time/update_cpu_s", "time/sync_cpu_s")
"""Process CPU seconds of a step's phases (every thread: the engine's, the update's); they
follow one another in the trainer, so their sum is the step's CPU."""


def step_cpu(line: dict[str, Any]) -> float | None:
    values = [v for key in CPU_PHASES if (v := _number(line.get(key))) is not None]
    return sum(values) if values else None


def cpu_figures(lines: list[dict[str, Any]], walls: list[float] | None, cores: int) -> dict[str, float | None]:
    """The run's CPU use: ``cpu_utilisation``, process CPU seconds over wall x cores; and
    ``overlap_bound_s``, the least wall an ideal overlap of the same work could take on
    ``cores`` cores: per step, the larger of the update's wall alone and all the step's CPU
    spread over every core (meaningful for a synchronous run, whose phases are measured alone)."""
    cpus = [step_cpu(line) for line in lines]
    updates = _column(lines, "time/update_s")
    if walls is None or not lines or any(c is None for c in cpus):
        return {"cpu_utilisation": None, "overlap_bound_s": None}
    used = sum(cpus) / (sum(walls) * cores) if sum(walls) > 0 else None  # type: ignore[arg-type]
    bound = None
    if updates is not None:
        bound = sum(max(u, c / cores) for u, c in zip(updates, cpus, strict=True))  # type: ignore[operator]
    return {"cpu_utilisation": used, "overlap_bound_s": bound}


def binomial_stderr(accuracy: float | None, prompts: int) -> float | None:
    if accuracy is None or prompts < 1:
        return None
    return math.sqrt(accuracy * (1 - accuracy) / prompts)


def summarize(lines: list[dict[str, Any]], mode: str, curve: list[dict[str, Any]], eval_prompts: int,
              cores: int = 1) -> dict[str, Any]:  # fmt: skip
    """A run's figures: the required keys (``time_to_sync_final_accuracy_s`` left None: it needs
    the sync run, ``add_time_to_sync_final``) and extras."""
    elapsed, source = elapsed_times(lines, mode)
    walls = step_walls(lines, elapsed)
    engine_idle, trainer_idle = idle_fractions(lines, mode, walls)
    staleness_mean, staleness_max = token_weighted_staleness(lines)
    steps = int(lines[-1]["step"]) if lines else 0
    wall = elapsed[-1] if elapsed else None
    final_accuracy = next((_number(p["accuracy"]) for p in curve if p["step"] == steps), None)
    return {
        "wall_s": wall,
        "steps": steps,
        "final_accuracy": final_accuracy,
        "time_to_sync_final_accuracy_s": None,
        "staleness_mean": staleness_mean,
        "staleness_max": staleness_max,
        "dropped": dropped_groups(lines, mode),
        "engine_idle_fraction": engine_idle,
        "trainer_idle_fraction": trainer_idle,
        "wall_per_step_s": wall / steps if wall is not None and steps else None,
        "final_accuracy_stderr": binomial_stderr(final_accuracy, eval_prompts),
        **cpu_figures(lines, walls, cores),
        "elapsed_source": source,
        "curve": curve,
    }


def add_time_to_sync_final(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Fill each mode's ``time_to_sync_final_accuracy_s`` of one workload against its sync run's
    final accuracy; returns the workload's ratios (async over sync)."""
    sync = results.get("sync") or {}
    target = sync.get("final_accuracy")
    for result in results.values():
        result["time_to_sync_final_accuracy_s"] = time_to_accuracy(result.get("curve") or [], target)
    other = results.get("async") or {}

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return top / bottom if top is not None and bottom else None

    accuracy_diff = stderr = None
    if other.get("final_accuracy") is not None and target is not None:
        accuracy_diff = other["final_accuracy"] - target
        errors = [sync.get("final_accuracy_stderr"), other.get("final_accuracy_stderr")]
        stderr = math.sqrt(sum(e**2 for e in errors)) if None not in errors else None
    sync_wall = sync.get("wall_s")
    return {
        "async_wall_over_sync_wall": ratio(other.get("wall_s"), sync_wall),
        "overlap_bound_over_sync_wall": ratio(sync.get("overlap_bound_s"), sync_wall),
        "async_time_to_sync_final_over_sync_wall": ratio(other.get("time_to_sync_final_accuracy_s"), sync_wall),
        "final_accuracy_async_minus_sync": accuracy_diff,
        "final_accuracy_diff_stderr": stderr,
    }


# ----- runs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What every run of the benchmark shares."""

    steps: int
    seed: int
    max_staleness: int
    checkpoint_every: int
    eval_prompts: int
    sets: tuple[str, ...] = ()


def run_values(workload: str, mode: str, settings: Settings, run_dir: Path) -> dict[str, Any]:
    """The config tree (given values only) of one run: ``--set`` first, then the benchmark's own."""
    values = merge_dotted({}, parse_set(list(settings.sets)))
    own = {
        "out": str(run_dir),
        "steps": settings.steps,
        "seed": settings.seed,
        "async_rl": mode == "async",
        "max_staleness": settings.max_staleness,
        "checkpoint_every": settings.checkpoint_every,
        "keep_checkpoints": 1_000_000,
        "progress": False,
    }
    if workload == "b":
        own["tools"] = str(run_dir / "slow_tools.yaml")
    return merge_dotted(values, own)


def slow_tools_yaml(seed: int) -> str:
    entry = {"class_name": "benchmarks.slow_tools:SlowCalculator", "config": {**SLOW_TOOL, "seed": seed}}
    return yaml.safe_dump({"tools": [entry]}, sort_keys=False)


def foreign(run_dir: Path) -> bool:
    """``run_dir`` holds something other than a run of this benchmark (which starts with train.yaml)."""
    return run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / "train.yaml").exists()


def fresh_run_dir(run_dir: Path) -> None:
    """An empty ``run_dir``; an old run of this benchmark there is removed, anything else refused."""
    if foreign(run_dir):
        raise SystemExit(f"{run_dir}: exists and is not a run of this benchmark; give another --out")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)


@dataclass
class Training:
    """What one ``rallyrl train`` subprocess did, seen from outside."""

    process_wall_s: float
    """From start to exit: start-up, model loading and the final save included."""
    arrivals: dict[int, float]
    """Seconds after the start at which each step's metrics line was first seen (polled every 0.1 s)."""
    error: str | None = None
    """The exit status and the log's last lines, if it failed."""


def run_training(run_dir: Path) -> Training:
    """``rallyrl train --config run_dir/train.yaml`` as a subprocess, output to ``train.log``,
    watching its ``metrics.jsonl`` for the time each step's line appears."""
    from trainer.metrics_log import read_metrics

    config_path, log_path, metrics_path = run_dir / "train.yaml", run_dir / "train.log", run_dir / "metrics.jsonl"
    arrivals: dict[int, float] = {}
    seen_size = 0

    def watch() -> None:
        nonlocal seen_size
        size = metrics_path.stat().st_size if metrics_path.exists() else 0
        if size != seen_size:
            seen_size, now = size, time.monotonic() - start
            for line in read_metrics(metrics_path):
                arrivals.setdefault(int(line["step"]), now)

    start = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "cli", "train", "--config", str(config_path)],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip
        try:
            while process.poll() is None:
                time.sleep(0.1)
                watch()
        finally:  # Ctrl-C or an error here: the run does not outlive the benchmark
            if process.poll() is None:
                process.kill()
                process.wait()
    training = Training(time.monotonic() - start, arrivals)
    watch()
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        training.error = f"rallyrl train exited with {process.returncode} (log {log_path}):\n" + "\n".join(tail)
    return training


class Evaluator:
    """Held-out greedy accuracy of model directories, on the same prompts each time."""

    def __init__(self, prompts: int, threads: int | None):
        from rollout.api import load_prompts, set_threads

        set_threads(threads)
        self.config = EvalConfig(seed=EVAL_SEED, num_prompts=prompts, threads=threads, progress=False)
        self.records = load_prompts(self.config, prompts)
        self.cache: dict[str, float | None] = {}

    def accuracy(self, model: str | None) -> float | None:
        """The model's greedy accuracy (None: nothing graded); the same model is evaluated once."""
        key = str(Path(model).resolve()) if model else "<embedded>"
        if key not in self.cache:
            self.cache[key] = asyncio.run(self._greedy(model))
        return self.cache[key]

    async def _greedy(self, model: str | None) -> float | None:
        from rollout.api import rollout_session
        from trainer.checkpoints import quiet_transformers
        from trainer.evaluation import evaluate

        config = dataclasses.replace(self.config, model=model)
        with quiet_transformers():
            async with rollout_session(config) as session:
                report = await evaluate(session.engine, session.chat, session.tools, self.records, config.rollout,
                                        samples_per_prompt=0, progress=False)  # fmt: skip
        return report["accuracy"]


def checkpoint_curve(run_dir: Path, lines: list[dict[str, Any]], mode: str, initial_model: str | None,
                     evaluator: Evaluator, console: Console) -> list[dict[str, Any]]:  # fmt: skip
    """(step, elapsed_s, accuracy) of the initial model (step 0, at 0 s) and of every checkpoint."""
    from trainer.checkpoints import complete_checkpoints

    elapsed, _ = elapsed_times(lines, mode)
    at_step = {int(m["step"]): t for m, t in zip(lines, elapsed, strict=True)} if elapsed else {}
    curve = [{"step": 0, "elapsed_s": 0.0, "accuracy": evaluator.accuracy(initial_model)}]
    for checkpoint in complete_checkpoints(run_dir / "checkpoints"):
        step = int(checkpoint.name.split("-")[-1])
        curve.append({"step": step, "elapsed_s": at_step.get(step), "accuracy": evaluator.accuracy(str(checkpoint))})
    for point in curve:
        console.print(f"    step {point['step']:>4}  {_fmt(point['elapsed_s'], '.1f', ' s')}  "
                      f"accuracy {_fmt(point['accuracy'], '.3f')}", highlight=False)  # fmt: skip
    return curve


def run_one(workload: str, mode: str, settings: Settings, out: Path, evaluator: Evaluator,
            console: Console) -> dict[str, Any]:  # fmt: skip
    """Train one (workload, mode), evaluate its checkpoints, and summarise it."""
    from trainer.metrics_log import read_metrics

    run_dir = (out / f"{workload}-{mode}").resolve()
    fresh_run_dir(run_dir)
    values = run_values(workload, mode, settings, run_dir)
    config = build(GRPOConfig, values)
    (run_dir / "train.yaml").write_text(yaml.safe_dump(values, sort_keys=False))  # first: it marks the directory
    if workload == "b":
        (run_dir / "slow_tools.yaml").write_text(slow_tools_yaml(settings.seed))
    console.print(f"[bold]{workload}/{mode}[/]: training {settings.steps} steps in {run_dir} ...", highlight=False)
    training = run_training(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    lines = read_metrics(metrics_path) if metrics_path.exists() else []
    if training.error is not None:
        console.print(f"{workload}/{mode} failed: {training.error}", style="red", highlight=False, markup=False)
    console.print(f"  {len(lines)} steps in {training.process_wall_s:.1f} s (whole process); evaluating checkpoints "
                  f"on {len(evaluator.records)} held-out prompts", highlight=False)  # fmt: skip
    curve = checkpoint_curve(run_dir, lines, mode, config.model, evaluator, console) if lines else []
    result = summarize(lines, mode, curve, len(evaluator.records), len(os.sched_getaffinity(0)))
    observed = observed_elapsed(lines, training.arrivals, step_walls(lines, elapsed_times(lines, mode)[0]))
    return {**result, "wall_observed_s": observed[-1] if observed else None, "observed_elapsed_s": observed,
            "process_wall_s": training.process_wall_s, "run_dir": str(run_dir), "error": training.error}  # fmt: skip


# ----- the report ------------------------------------------------------------------------------


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{unit}"


def results_table(workload: str, results: dict[str, dict[str, Any]], ratios: dict[str, float | None]) -> Table:
    bound = _fmt(ratios.get("overlap_bound_over_sync_wall"), ".2f")
    caption = (f"async/sync wall {_fmt(ratios['async_wall_over_sync_wall'], '.2f')} (an ideal overlap of sync's "
               f"work on these cores: {bound}); async reaches sync's final accuracy at "
               f"{_fmt(ratios['async_time_to_sync_final_over_sync_wall'], '.2f')} of sync's wall; "
               f"final accuracy async - sync {_fmt(ratios['final_accuracy_async_minus_sync'], '+.3f')} "
               f"(± {_fmt(ratios['final_accuracy_diff_stderr'], '.3f')} stderr)")  # fmt: skip
    table = Table(title=f"workload {workload}: {WORKLOADS[workload]}", caption=caption)
    columns = ("mode", "steps", "wall s", "observed s", "s/step", "CPU used", "engine idle", "trainer idle",
               "stale mean", "stale max", "dropped", "final accuracy", "t to sync final s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, r in results.items():
        accuracy = _fmt(r["final_accuracy"], ".3f")
        if r.get("final_accuracy_stderr") is not None:
            accuracy += f" ± {r['final_accuracy_stderr']:.3f}"
        table.add_row(
            mode + (" (failed)" if r.get("error") else ""), str(r["steps"]), _fmt(r["wall_s"], ".1f"),
            _fmt(r.get("wall_observed_s"), ".1f"), _fmt(r.get("wall_per_step_s"), ".2f"),
            _fmt(r.get("cpu_utilisation"), ".0%"), _fmt(r["engine_idle_fraction"], ".0%"),
            _fmt(r["trainer_idle_fraction"], ".0%"),
            _fmt(r["staleness_mean"], ".2f"), _fmt(r["staleness_max"], "d"), _fmt(r["dropped"], "d"), accuracy,
            _fmt(r["time_to_sync_final_accuracy_s"], ".1f"),
        )  # fmt: skip
    return table


def plot(report: dict[str, Any], path: Path) -> None:
    """Held-out greedy accuracy against training wall time, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["results"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for axis, workload in zip(axes[0], workloads, strict=True):
        for mode, result in report["results"][workload].items():
            points = [p for p in result.get("curve") or [] if p["elapsed_s"] is not None and p["accuracy"] is not None]
            axis.plot([p["elapsed_s"] for p in points], [p["accuracy"] for p in points], marker="o", markersize=4,
                      label=f"{mode} ({result['steps']} steps)")  # fmt: skip
        target = report["results"][workload].get("sync", {}).get("final_accuracy")
        if target is not None:
            axis.axhline(target, color="grey", linestyle="--", linewidth=1, label="sync final")
        axis.set_title(f"{workload}: {WORKLOADS[workload]}", fontsize=9)
        axis.set_xlabel("training wall time (s)")
        axis.set_ylabel(f"held-out greedy accuracy ({report['settings']['eval_prompts']} prompts)")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


def clock_warning(name: str, result: dict[str, Any]) -> str | None:
    """A warning where the trainer's clock and the observed one differ by more than 3 % (and 1 s)."""
    wall, observed = result["wall_s"], result["wall_observed_s"]
    if wall is None or observed is None or abs(observed - wall) <= max(1.0, 0.03 * wall):
        return None
    return (f"{name}: the trainer's clock says {wall:.1f} s, its metrics lines appeared over {observed:.1f} s "
            "(between steps: checkpoint saves, logging)")  # fmt: skip


def run_benchmark(workloads: list[str], modes: list[str], settings: Settings, out: Path, console: Console,
                  threads: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Every (workload, mode) run, one after another; the report (``--json``'s content)."""
    warnings = []
    if "async" in modes and importlib.util.find_spec("trainer.async_rl") is None:
        warnings.append("trainer/async_rl.py is missing: the async runs may have trained synchronously")
    evaluator = Evaluator(settings.eval_prompts, threads)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    ratios: dict[str, dict[str, float | None]] = {}
    for workload in workloads:
        results[workload] = {mode: run_one(workload, mode, settings, out, evaluator, console) for mode in modes}
        ratios[workload] = add_time_to_sync_final(results[workload])
        warnings += [w for mode, r in results[workload].items() if (w := clock_warning(f"{workload}/{mode}", r))]
        sources = {r["elapsed_source"] for r in results[workload].values()}
        if sources != {"time/elapsed_s"}:
            warnings.append(f"workload {workload}: elapsed times from {', '.join(sorted(sources))}, not the "
                            "trainer's time/elapsed_s (see the module docstring)")  # fmt: skip
        if len(sources) > 1:
            warnings.append(f"workload {workload}: elapsed times come from {', '.join(sorted(sources))}: "
                            "not measured alike in both modes")  # fmt: skip
    shared = {**dataclasses.asdict(settings), "sets": list(settings.sets), "workloads": workloads, "modes": modes}
    return {
        "settings": {**shared, "eval_seed": EVAL_SEED, "slow_tool": SLOW_TOOL},
        "results": results,
        "ratios": ratios,
        "warnings": warnings,
    }


def main() -> None:
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps, help="GRPO steps of every run")
    parser.add_argument("--workloads", default="a,b", help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness, help="async mode's bound")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between evaluated checkpoints")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of every run (and of the slow tool)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a train config field for every run, e.g. prompts_per_step=8 (repeatable)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch threads of the evaluations (training: --set threads=N)")
    parser.add_argument("--out", type=Path, default=Path("out/async_rl"), help="run directories go here")
    parser.add_argument("--plot", type=Path, help="accuracy against wall time PNG (default: OUT/accuracy_vs_wall.png)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [w for w in workloads if w not in WORKLOADS] or [m for m in modes if m not in MODES]:
        parser.error(f"unknown workload or mode {', '.join(unknown)} (workloads: a, b; modes: sync, async)")
    if args.steps < 1 or args.eval_prompts < 1 or args.checkpoint_every < 1:
        parser.error("--steps, --eval-prompts and --checkpoint-every must be >= 1")
    settings = Settings(args.steps, args.seed, args.max_staleness, args.checkpoint_every, args.eval_prompts,
                        tuple(args.set))  # fmt: skip
    try:
        if taken := [key for key in parse_set(args.set) if key.split(".")[0] in CONTROLLED]:
            parser.error(f"--set {', '.join(taken)}: the benchmark sets it; use its flag (--steps, --seed, ...)")
        for workload in workloads:  # every run's config and directory is checked before the first starts
            build(GRPOConfig, run_values(workload, "async", settings, args.out / "check"))
            if taken := [str(args.out / f"{workload}-{m}") for m in modes if foreign(args.out / f"{workload}-{m}")]:
                parser.error(f"{', '.join(taken)}: not a run of this benchmark, so not overwritten; give another --out")
    except ConfigError as exc:
        parser.error(f"--set: {exc}")

    console = Console(width=160)
    before = machine_state()
    console.print(f"{', '.join(workloads)} x {', '.join(modes)}: {settings.steps} steps, seed {settings.seed}, "
                  f"max_staleness {settings.max_staleness}, checkpoints every {settings.checkpoint_every} steps, "
                  f"{settings.eval_prompts} held-out prompts; --set {' '.join(args.set) or '(none)'}\n"
                  f"load average at start {before['loadavg']} on {before['cpus']} cores; busiest:",
                  highlight=False)  # fmt: skip
    console.print("\n".join("  " + line for line in before["busiest"]), highlight=False, markup=False)
    report = run_benchmark(workloads, modes, settings, args.out, console, args.threads)
    after = machine_state()
    report["machine_start"], report["machine_end"] = before, after
    for workload, results in report["results"].items():
        console.print(results_table(workload, results, report["ratios"][workload]))
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    console.print(f"load average at end {after['loadavg']}", highlight=False)
    plot_path = args.plot or args.out / "accuracy_vs_wall.png"
    plot(report, plot_path)
    console.print(f"wrote {plot_path}", highlight=False)
    if args.json:
        atomic_write_bytes(args.json, orjson.dumps(report, option=orjson.OPT_INDENT_2))
        console.print(f"wrote {args.json}", highlight=False)
    failed = [f"{w}/{m}" for w, results in report["results"].items() for m, r in results.items() if r["error"]]
    if failed:
        console.print(f"[red]failed runs: {', '.join(failed)}[/]")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
