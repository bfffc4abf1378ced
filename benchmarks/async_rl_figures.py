"""``benchmarks/async_rl.py``'s figures, read from a run's metrics lines (pure functions): elapsed
and idle times, staleness, dropped groups, time to accuracy, CPU use, the summary of a run."""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any


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
