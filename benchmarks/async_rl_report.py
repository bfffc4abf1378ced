"""``benchmarks/async_rl.py``'s report: the results table, the accuracy-over-time plot and the
warning on an unsteady clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from data.files import atomic_write_with

WORKLOADS = {
    "a": "calc task, rallyrl train defaults",
    "b": "calc task, calculator behind a lognormal latency (median 0.3 s, sigma 1)",
}
"""The benchmark's workloads, as the report names them."""


def fmt(value: Any, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{unit}"


def results_table(workload: str, results: dict[str, dict[str, Any]], ratios: dict[str, float | None]) -> Table:
    bound = fmt(ratios.get("overlap_bound_over_sync_wall"), ".2f")
    caption = (f"async/sync wall {fmt(ratios['async_wall_over_sync_wall'], '.2f')} (an ideal overlap of sync's "
               f"work on these cores: {bound}); async reaches sync's final accuracy at "
               f"{fmt(ratios['async_time_to_sync_final_over_sync_wall'], '.2f')} of sync's wall; "
               f"final accuracy async - sync {fmt(ratios['final_accuracy_async_minus_sync'], '+.3f')} "
               f"(± {fmt(ratios['final_accuracy_diff_stderr'], '.3f')} stderr)")  # fmt: skip
    table = Table(title=f"workload {workload}: {WORKLOADS[workload]}", caption=caption)
    columns = ("mode", "steps", "wall s", "observed s", "s/step", "CPU used", "engine idle", "trainer idle",
               "stale mean", "stale max", "dropped", "final accuracy", "t to sync final s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, r in results.items():
        accuracy = fmt(r["final_accuracy"], ".3f")
        if r.get("final_accuracy_stderr") is not None:
            accuracy += f" ± {r['final_accuracy_stderr']:.3f}"
        table.add_row(
            mode + (" (failed)" if r.get("error") else ""), str(r["steps"]), fmt(r["wall_s"], ".1f"),
            fmt(r.get("wall_observed_s"), ".1f"), fmt(r.get("wall_per_step_s"), ".2f"),
            fmt(r.get("cpu_utilisation"), ".0%"), fmt(r["engine_idle_fraction"], ".0%"),
            fmt(r["trainer_idle_fraction"], ".0%"),
            fmt(r["staleness_mean"], ".2f"), fmt(r["staleness_max"], "d"), fmt(r["dropped"], "d"), accuracy,
            fmt(r["time_to_sync_final_accuracy_s"], ".1f"),
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
