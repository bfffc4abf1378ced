"""The metrics of a run: ``metrics.jsonl`` (one line per step, appended as it ends), the console
line, and the curves PNG. Shared by GRPO and SFT.

Metric names carry their family: ``rollout/`` (what the rollouts did: reward, accuracy, lengths,
tool calls and their malformed and failed shares, staleness), ``train/`` (the update: loss, KL, clipping,
entropy, gradient norm and its ratio to the recent median, lr, the collapse warning), ``correction/``
(the rollout correction: the ratio pi_trainer / pi_engine, what it masked, KL(engine || trainer)) and
``time/`` (wall and CPU seconds per phase, throughput); ``step`` stands alone.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from data.files import atomic_write_bytes, atomic_write_with
from data.line_files import LineAppender


def append_metrics(path: Path, metrics: dict[str, Any]) -> None:
    """One line, flushed: a kill loses at most the line being written."""
    with LineAppender(path, what="metrics line", after_full="free some space and run again with --resume") as file:
        file.write(orjson.dumps(metrics, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a metrics file; a last line cut short by a kill is left out."""
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    return [orjson.loads(line) for line in complete.splitlines() if line.strip()]


def keep_metrics_until(path: Path, step: int) -> list[dict[str, Any]]:
    """Drop the lines of steps after ``step`` (a resumed run does them again); returns the rest."""
    if not path.exists():
        return []
    history = [m for m in read_metrics(path) if m["step"] <= step]
    atomic_write_bytes(path, b"".join(orjson.dumps(m) + b"\n" for m in history))
    return history


def _value(metrics: dict[str, Any], key: str) -> float:
    value = metrics.get(key)
    return math.nan if value is None else float(value)


CONSOLE_FIELDS = (
    ("rollout/reward_mean", "reward {:.3f}"),
    ("rollout/reward_std", "±{:.3f}"),
    ("rollout/accuracy", "  acc {:.3f}"),
    ("rollout/solve_all", "  solve_all {:.0f}"),
    ("rollout/solve_none", " none {:.0f}"),
    ("rollout/response_length", "  len {:.0f}"),
    ("rollout/turns", "  turns {:.2f}"),
    ("rollout/tool_calls", "  tools {:.2f}"),
    ("rollout/malformed_call_share", " malformed {:.2f}"),
    ("rollout/user_turns", "  user {:.2f}"),
    ("train/kl", "  kl {:.4f}"),
    ("train/clip_fraction", "  clip {:.3f}"),
    ("train/entropy", "  ent {:.3f}"),
    ("train/grad_norm", "  gnorm {:.3f}"),
    ("train/lr", "  lr {:.2e}"),
    ("time/rollout_s", "  rollout {:.1f}s"),
    ("time/wait_s", "  wait {:.1f}s"),
    ("time/update_s", " update {:.1f}s"),
    ("time/sync_s", " sync {:.2f}s"),
    ("rollout/staleness_mean", "  stale {:.2f}"),
    ("time/update_tokens_per_s", "  {:.0f} train tok/s"),
)
"""What the console line of a GRPO step shows, in order (those the step has: async steps wait for
rollouts rather than run them)."""


def console_line(metrics: dict[str, Any]) -> str:
    fields = (fmt.format(_value(metrics, k)) for k, fmt in CONSOLE_FIELDS if k in metrics)
    return f"step {metrics['step']:>3}  " + "".join(fields)


CURVES = (
    ("rollout/reward_mean", "rollout/reward_mean"),
    ("rollout/accuracy", "rollout/accuracy"),
    ("rollout/tool_calls", "rollout/tool_calls (per trajectory)"),
    ("train/entropy", "train/entropy"),
)


USER_TURNS_CURVE = ("rollout/user_turns", "rollout/user_turns (per request: attempts)")
"""Added to the curves of a run with an interaction (the answer checker: attempts per request)."""


def plot_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Reward, accuracy, tool calls and entropy per step (and user turns, with an interaction),
    one PNG (written atomically)."""
    curves = [*CURVES, USER_TURNS_CURVE] if any(USER_TURNS_CURVE[0] in m for m in history) else list(CURVES)
    plot_panels(history, [(title, [key]) for key, title in curves], path, columns=len(curves), mean_of=5)


def plot_panels(history: list[dict[str, Any]], panels: list[tuple[str, list[str]]], path: Path, columns: int = 3,
                mean_of: int = 0, mark_step: int | None = None) -> None:  # fmt: skip
    """One PNG (written atomically) of ``panels``: each a title and the metric keys drawn on it per step,
    with their ``mean_of``-step running mean (0: none) and a dashed line at ``mark_step``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for axis, (title, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            values = np.array([_value(m, key) for m in history], dtype=float)
            axis.plot(steps, values, marker="o", markersize=3, label=key if len(keys) > 1 else "per step")
            if mean_of and len(values) >= mean_of:
                mean = np.convolve(values, np.ones(mean_of) / mean_of, mode="valid")
                axis.plot(steps[mean_of - 1 :], mean, label=f"{mean_of}-step mean")
        if mark_step is not None:
            axis.axvline(mark_step, color="red", linestyle="--", linewidth=1, label="collapse warning")
        axis.set_xlabel("step")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


class PhaseTimer:
    """Wall and CPU seconds (this process: every thread, the engine's included) of named phases."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        wall, cpu = time.monotonic(), time.process_time()
        try:
            yield
        finally:
            self.wall[phase] = self.wall.get(phase, 0.0) + time.monotonic() - wall
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.process_time() - cpu

    def seconds(self) -> dict[str, float]:
        return {**{f"{k}_s": v for k, v in self.wall.items()}, **{f"{k}_cpu_s": v for k, v in self.cpu.items()}}


def step_progress(console: Console, enabled: bool) -> Progress:
    """Steps done, reward and accuracy of the last step, time left."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  acc {task.fields[acc]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )
