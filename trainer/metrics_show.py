"""``rallyrl show`` of a run's ``metrics.jsonl``: its diagnostics as a short table and a PNG, with the
collapse warning (``trainer/collapse.py``) where the run had one; any other file is a trajectory file
and goes on to the trajectory view (``rollout/files/commands.py``).

A file is a metrics file when its first line is a JSON object with a ``step`` and no ``request_id``.
The panels: accuracy and reward, the malformed-call and tool-error shares, entropy, the gradient
norm and its ratio to the steps before, and every ``correction/`` metric the run logged (the rollout
correction's); only those the file has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import typer
from rich.console import Group
from rich.table import Table

from data.console import fail
from trainer.collapse import COLLAPSE_WARNING, GRAD_NORM_RATIO, Collapse, first_collapse, value

PANELS = (
    ("accuracy and reward", ["rollout/accuracy", "rollout/reward_mean"]),
    ("malformed tool calls (share of calls)", ["rollout/malformed_call_share"]),
    ("tool errors (share of calls run)", ["rollout/tool_error_share"]),
    ("entropy", ["train/entropy"]),
    ("gradient norm", ["train/grad_norm"]),
    ("gradient norm / median of the 10 before", [GRAD_NORM_RATIO]),
    ("KL to the reference", ["train/kl"]),
)
"""The diagnostics plotted (those the file has), then one panel per ``correction/`` metric."""


def is_metrics_file(path: Path) -> bool:
    """Whether ``path``'s first line is a step's metrics (a JSON object with ``step``, no ``request_id``)."""
    try:
        with path.open("rb") as handle:
            first = next((line for line in handle if line.strip()), b"")
        record = orjson.loads(first)
    except (OSError, orjson.JSONDecodeError):
        return False
    return isinstance(record, dict) and "step" in record and "request_id" not in record


def diagnostic_panels(history: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """``PANELS`` with the keys ``history`` has, then each ``correction/`` key it has, in order."""
    seen = {key for metrics in history for key in metrics}
    panels = [(title, [k for k in keys if k in seen]) for title, keys in PANELS]
    corrections = sorted(key for key in seen if key.startswith("correction/"))
    return [(title, keys) for title, keys in panels if keys] + [(key, [key]) for key in corrections]


def diagnostics_table(history: list[dict[str, Any]], panels: list[tuple[str, list[str]]]) -> Table:
    """First, last, min and max of each diagnostic over the steps where it is known."""
    table = Table(title=f"diagnostics: steps {history[0]['step']}-{history[-1]['step']}")
    for column in ("metric", "first", "last", "min", "max"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key in (key for _, keys in panels for key in keys):
        known = [v for m in history if (v := value(m, key)) is not None]
        if known:
            table.add_row(key, *(f"{v:.4g}" for v in (known[0], known[-1], min(known), max(known))))
    return table


def collapse_of(history: list[dict[str, Any]]) -> Collapse | None:
    """The run's collapse: found again from its metrics; a flag the run logged where the rules now find none."""
    found = first_collapse(history)
    flagged = next((m for m in history if value(m, COLLAPSE_WARNING)), None)
    if found is None and flagged is not None:
        step = int(flagged["step"])
        return Collapse(step, "logged", f"collapse warning at step {step} (logged by the run)")
    return found


def show_metrics(path: Path, plot: Path) -> Group:
    """The diagnostics of metrics file ``path`` (its PNG written to ``plot``), for the console."""
    from trainer.metrics_log import plot_panels, read_metrics  # (numpy, matplotlib: not at the CLI's start)

    history = [m for m in read_metrics(path) if isinstance(m.get("step"), int)]
    if not history:
        raise ValueError(f"{path} holds no complete step of metrics")
    panels = diagnostic_panels(history)
    collapse = collapse_of(history)
    plot_panels(history, panels, plot, columns=min(3, max(len(panels), 1)),
                mark_step=None if collapse is None else collapse.step)  # fmt: skip
    warning = "no collapse warning" if collapse is None else f"[bold yellow]{collapse.message}[/]"
    return Group(diagnostics_table(history, panels), warning, f"wrote {plot}")


def show_command(
    file: Path = typer.Argument(..., help="A rollout JSONL file, its parquet export, or a run's metrics.jsonl."),
    index: int = typer.Option(None, help="Which trajectory, 0-based in file order (default: the first)."),
    model: Path = typer.Option(None, help="Model or tokenizer directory: decode the token spans to text."),
    plot: Path = typer.Option(
        None, help="A metrics file: where to write the diagnostics PNG (default: beside it, NAME-diagnostics.png)."
    ),
) -> None:
    """Pretty-print one trajectory: header, every turn with its tool calls, and the token view
    (which spans of response_ids are trained on, loss_mask 1, and which are context). For a run's
    metrics.jsonl: its diagnostics (accuracy, reward, malformed tool calls, tool errors, entropy,
    gradient norm, correction/ metrics) as a table and a PNG, and its collapse warning."""
    from rich.console import Console

    from rollout.files.commands import show_command as show_trajectory

    if not is_metrics_file(file):
        show_trajectory(file, index, model)
        return
    try:
        shown = show_metrics(file, plot or file.with_name(f"{file.stem}-diagnostics.png"))
    except (OSError, ValueError) as exc:
        raise fail(f"{file}: {getattr(exc, 'strerror', None) or exc}") from None
    Console().print(shown, highlight=False)
