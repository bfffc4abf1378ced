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
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.console import Console

from benchmarks.async_rl_figures import add_time_to_sync_final, elapsed_times, observed_elapsed, step_walls, summarize
from benchmarks.async_rl_report import WORKLOADS, clock_warning, fmt, plot, results_table
from benchmarks.engines import machine_state
from benchmarks.waits import stop_process
from data.config_tree import ConfigError, build, merge_dotted, parse_set
from data.files import atomic_write_bytes
from rollout.serve.processes import stop_on_sigterm
from trainer.config import EvalConfig, GRPOConfig

REPO = Path(__file__).resolve().parents[1]
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
    run_timeout_s: float = 4 * 3600.0
    """Deadline of each ``rallyrl train`` run; past it the run is stopped and reported failed."""


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


def run_training(run_dir: Path, timeout_s: float = Settings.run_timeout_s) -> Training:
    """``rallyrl train --config run_dir/train.yaml`` as a subprocess, output to ``train.log``,
    watching its ``metrics.jsonl`` for the time each step's line appears; stopped (and failed) when
    it has not finished within ``timeout_s``, and on every way out of this function."""
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
            while process.poll() is None and time.monotonic() - start < timeout_s:
                time.sleep(0.1)
                watch()
        finally:  # past the deadline, Ctrl-C, SIGTERM or an error here: the run does not outlive the benchmark
            timed_out = process.poll() is None
            stop_process(process, grace_s=30)
    training = Training(time.monotonic() - start, arrivals)
    watch()
    if timed_out:
        training.error = (
            f"rallyrl train did not finish within {timeout_s:g} s (--run-timeout-s); stopped (log {log_path})"
        )
    elif process.returncode != 0:
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
        console.print(f"    step {point['step']:>4}  {fmt(point['elapsed_s'], '.1f', ' s')}  "
                      f"accuracy {fmt(point['accuracy'], '.3f')}", highlight=False)  # fmt: skip
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
    training = run_training(run_dir, settings.run_timeout_s)
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


@stop_on_sigterm()
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
    parser.add_argument("--run-timeout-s", type=float, default=Settings.run_timeout_s,
                        help="deadline of each training run (it is stopped and reported failed past it)")  # fmt: skip
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [w for w in workloads if w not in WORKLOADS] or [m for m in modes if m not in MODES]:
        parser.error(f"unknown workload or mode {', '.join(unknown)} (workloads: a, b; modes: sync, async)")
    if args.steps < 1 or args.eval_prompts < 1 or args.checkpoint_every < 1:
        parser.error("--steps, --eval-prompts and --checkpoint-every must be >= 1")
    settings = Settings(args.steps, args.seed, args.max_staleness, args.checkpoint_every, args.eval_prompts,
                        tuple(args.set), args.run_timeout_s)  # fmt: skip
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
