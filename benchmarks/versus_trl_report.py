"""The figures of ``benchmarks/versus_trl.py`` from its results: the summary per trainer, the
console tables, and the curves of held-out accuracy against CPU-seconds (PNG)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

COLORS = {"rallyrl": "tab:blue", "trl": "tab:orange"}
NAMES = {"rallyrl": "rallyrl", "trl": "TRL"}
CPU_PER_STEP_TARGET = 0.6
"""rallyrl's CPU per step at most this share of TRL's (issue 51)."""


def spread(values: list[float]) -> dict[str, float]:
    """Mean, min and max (NaN of nothing)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def chosen_runs(results: dict[str, Any], trainer: str) -> list[dict[str, Any]]:
    """The trainer's runs at its chosen learning rate, one per seed."""
    lr = results["chosen_lr"][trainer]
    return [r for r in results["runs"] if r["trainer"] == trainer and r["lr"] == lr]


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Per trainer over its seeds: held-out accuracy at the start and at the budget, the gain, CPU per
    step and per sampled token, peak RSS; the ratio of CPU per step and the issue's two targets."""
    start = results["start"]["accuracy"]
    summary: dict[str, Any] = {}
    for trainer in results["chosen_lr"]:
        runs = chosen_runs(results, trainer)
        sweep = {
            r["lr"]: r["curve"][-1]["accuracy"]
            for r in results["runs"]
            if r["trainer"] == trainer and r["phase"] == "sweep"
        }
        summary[trainer] = {
            "lr": results["chosen_lr"][trainer],
            "seeds": [r["seed"] for r in runs],
            "sweep_accuracy_at_budget": sweep,
            "start_accuracy": start,
            "accuracy_at_budget": spread([r["curve"][-1]["accuracy"] for r in runs]),
            "gain": spread([r["curve"][-1]["accuracy"] - start for r in runs]),
            "cpu_s_at_budget_point": spread([r["curve"][-1]["cpu_s"] for r in runs]),
            "steps_within_budget": spread(
                [float(len([s for s in r["steps"] if s["cpu_s"] <= r["budget_cpu_s"]])) for r in runs]
            ),
            "cpu_s_per_step": spread([r["cpu_s_per_step"] for r in runs]),
            "cpu_ms_per_sampled_token": spread([r["cpu_ms_per_sampled_token"] for r in runs]),
            "peak_rss_gb": spread([r["peak_rss_bytes"] / 1e9 for r in runs]),
            "malformed_call_share_at_budget": spread([r["curve"][-1]["malformed_call_share"] for r in runs]),
        }
    if {"rallyrl", "trl"} <= summary.keys():
        ours, theirs = summary["rallyrl"], summary["trl"]
        ratio = ours["cpu_s_per_step"]["mean"] / theirs["cpu_s_per_step"]["mean"]
        summary["cpu_per_step_ratio"] = ratio
        summary["targets"] = {
            "gain_at_least_trls": ours["gain"]["mean"] >= theirs["gain"]["mean"],
            f"cpu_per_step_at_most_{CPU_PER_STEP_TARGET}x": ratio <= CPU_PER_STEP_TARGET,
        }
    return summary


def _spread_text(value: dict[str, float], digits: int = 3) -> str:
    if math.isnan(value["mean"]):
        return "-"
    return f"{value['mean']:.{digits}f} [{value['min']:.{digits}f}, {value['max']:.{digits}f}]"


def print_report(results: dict[str, Any], console: Console) -> None:
    summary = results.get("summary") or summarise(results)
    budget = results["settings"]["budget_cpu_s"]
    table = Table(
        title=f"held-out greedy accuracy at {budget:g} CPU-s per run, {results['settings']['threads']} "
        f"thread(s); mean [min, max] over seeds"
    )
    for column in (
        "trainer",
        "lr",
        "seeds",
        "start",
        "at budget",
        "gain",
        "steps",
        "CPU-s/step",
        "CPU-ms/sampled tok",
        "peak RSS GB",
    ):
        table.add_column(column, justify="left" if column == "trainer" else "right")
    for trainer, figures in summary.items():
        if trainer not in NAMES:
            continue
        table.add_row(
            NAMES[trainer],
            f"{figures['lr']:g}",
            ",".join(map(str, figures["seeds"])),
            f"{figures['start_accuracy']:.3f}",
            _spread_text(figures["accuracy_at_budget"]),
            _spread_text(figures["gain"]),
            _spread_text(figures["steps_within_budget"], 0),
            _spread_text(figures["cpu_s_per_step"], 1),
            _spread_text(figures["cpu_ms_per_sampled_token"], 2),
            _spread_text(figures["peak_rss_gb"], 2),
        )
    console.print(table)
    sweep = Table(title="learning-rate sweep: held-out accuracy at the budget, first seed")
    sweep.add_column("trainer")
    lrs = sorted(
        {
            lr
            for t in summary.values()
            if isinstance(t, dict) and "sweep_accuracy_at_budget" in t
            for lr in t["sweep_accuracy_at_budget"]
        }
    )
    for lr in lrs:
        sweep.add_column(f"lr {lr:g}", justify="right")
    for trainer, figures in summary.items():
        if trainer in NAMES:
            found = figures["sweep_accuracy_at_budget"]
            sweep.add_row(NAMES[trainer], *(f"{found[lr]:.3f}" if lr in found else "-" for lr in lrs))
    console.print(sweep)
    if "cpu_per_step_ratio" in summary:
        console.print(
            f"CPU per step, rallyrl / TRL: {summary['cpu_per_step_ratio']:.2f}x (target <= "
            f"{CPU_PER_STEP_TARGET}x); targets: {summary['targets']}"
        )
    console.print("start: the embedded model (no SFT). What TRL 1.16 lacks for this task (the runner works around it):")
    for line in results["trl_lacks"]:
        console.print(f"  - {line}")


def write_plot(results: dict[str, Any], path: str | Path) -> Path:
    """Held-out accuracy against CPU-seconds, every run: the chosen learning rate's solid, the rest
    of the sweep dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for run in results["runs"]:
        chosen = run["lr"] == results["chosen_lr"].get(run["trainer"])
        xs = [point["cpu_s"] for point in run["curve"]]
        ys = [point["accuracy"] for point in run["curve"]]
        label = f"{NAMES[run['trainer']]} seed {run['seed']} lr {run['lr']:g}"
        axes.plot(
            xs,
            ys,
            marker="o",
            color=COLORS[run["trainer"]],
            linestyle="-" if chosen else "--",
            alpha=0.9 if chosen else 0.45,
            label=label,
        )
    axes.axvline(results["settings"]["budget_cpu_s"], color="gray", linewidth=0.8, linestyle=":")
    axes.set_xlabel(f"process CPU-seconds ({results['settings']['threads']} thread)")
    axes.set_ylabel(f"held-out greedy accuracy ({results['start']['prompts']} prompts)")
    axes.set_title("GRPO on the calc task from the embedded model: rallyrl vs TRL 1.16")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
