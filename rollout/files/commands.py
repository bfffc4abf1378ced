"""``rallyrl check``, ``export`` and ``show``: commands on rollout JSONL files."""

from __future__ import annotations

from pathlib import Path

import orjson
import typer

from data.console import console
from data.console import fail as _fail


def check(file: Path = typer.Argument(..., help="A rollout JSONL file.")) -> None:
    """Validate every trajectory line of a rollout JSONL file."""
    from rollout.request import validate_trajectory

    try:
        lines = file.read_bytes().splitlines()
    except OSError as exc:
        raise _fail(f"{file}: {exc.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            validate_trajectory(orjson.loads(line))
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise _fail(f"{file} line {number}: {exc}") from None
    console.print(f"{file}: {sum(1 for line in lines if line.strip())} valid trajectories")


def export_command(
    file: Path = typer.Argument(..., help="A rollout JSONL file."),
    out: Path = typer.Option(None, help="Parquet file to write (default: FILE with the suffix .parquet)."),
    batch_size: int = typer.Option(1024, help="Trajectories converted (and held in memory) at a time."),
) -> None:
    """Rollout JSONL -> parquet, one row per trajectory (schema: rollout/files/export.py), streamed in
    batches and written atomically: a bad line is an error naming it, and nothing is written."""
    from rollout.files.export import ExportError, export_parquet

    out = out or file.with_suffix(".parquet")
    try:
        count = export_parquet(file, out, batch_size=batch_size)
    except (ExportError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:  # the output cannot be written
        raise _fail(f"--out {out}: {exc.strerror or exc}") from None
    console.print(f"wrote {count} trajectories to {out}", highlight=False)


def show_command(
    file: Path = typer.Argument(..., help="A rollout JSONL file or its parquet export."),
    index: int = typer.Option(None, help="Which trajectory, 0-based in file order (default: the first)."),
    model: Path = typer.Option(None, help="Model or tokenizer directory: decode the token spans to text."),
) -> None:
    """Pretty-print one trajectory: header, every turn with its tool calls, and the token view
    (which spans of response_ids are trained on, loss_mask 1, and which are context)."""
    from rich.console import Console

    from rollout.files.show import ShowError, load_trajectory, render

    try:
        tokenizer = None
        if model is not None:
            from rollout.tokens import load_tokenizer

            try:
                tokenizer = load_tokenizer(model)
            except (OSError, ValueError) as exc:
                raise ShowError(f"--model {model}: cannot load a tokenizer ({exc})") from None
        located = load_trajectory(file, 0 if index is None else index)
    except ShowError as exc:
        raise _fail(str(exc)) from None
    Console().print(render(located, file, tokenizer))
