"""The console every command prints to (stderr, so stdout stays for data), and its error line."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` and return the exit (code 2) to raise: bad input, no stack trace."""
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code=2)
