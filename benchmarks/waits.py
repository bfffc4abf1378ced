"""Deadlines of the benchmarks' waits, and the processes they start stopped on every way out.

Each wait that may not end (a run against a server that stopped answering, a child process that
never says it is ready) has a deadline; past it, ``WaitTimeout`` names what was waited for, for how
long, and the flag that gives it longer. SIGTERM is handled as Ctrl-C by each benchmark's ``main``
(``stop_on_sigterm`` of ``rollout/serve/processes.py``), so the ``finally`` blocks here run then too.
"""

from __future__ import annotations

import asyncio
import select
import subprocess
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """A benchmark's wait passed its deadline; the message says what it waited for and for how long."""


async def finish_within(awaitable: Awaitable[T], timeout_s: float, what: str, flag: str) -> T:
    """``await awaitable``, or WaitTimeout naming ``what`` and the ``flag`` that sets ``timeout_s``
    once ``timeout_s`` has passed (the awaitable is cancelled)."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return await awaitable
    except TimeoutError:
        if deadline.expired():  # (not a TimeoutError of the awaitable's own)
            raise WaitTimeout(f"{what} did not finish within {timeout_s:g} s ({flag})") from None
        raise


def read_line(process: subprocess.Popen[str], timeout_s: float, what: str) -> str:
    """The next line ``process`` writes to its stdout (a pipe), or WaitTimeout naming ``what`` when
    none comes within ``timeout_s``; "" when it closed its stdout (exited)."""
    assert process.stdout is not None, "start the process with stdout=subprocess.PIPE"
    readable, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not readable:
        raise WaitTimeout(f"{what}: nothing written within {timeout_s:g} s")
    return process.stdout.readline()


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL when it has not exited within ``grace_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
