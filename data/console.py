"""The console every command prints to (stderr, so stdout stays for data), and its error line."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` and return the exit to raise (code 2: bad input), no stack trace."""
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code)
