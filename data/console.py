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


STUCK_EXIT_CODE = 3
"""A command whose work is done but whose environment or tool calls never returned exits with this."""


def stuck_exit(code: int = 0) -> typer.Exit | None:
    """As a command ends: calls into environments or tools still stuck get a last moment to return within
    their own deadline (5 s at most: a request cancelled mid-step, so its environment is closed); one line
    names those that never do, and the exit is non-zero (``code``, else ``STUCK_EXIT_CODE``). None, or
    ``code``'s exit, when nothing is stuck. The stuck calls' threads do not keep the process alive."""
    from rollout.user_threads import stuck_line, wait_for_stuck

    wait_for_stuck(5.0)
    line = stuck_line()
    if line is None:
        return typer.Exit(code=code) if code else None
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code or STUCK_EXIT_CODE)
