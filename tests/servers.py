"""Real ``rallyrl serve`` processes on loopback for tests (``rollout/serve/processes.py``)."""

from __future__ import annotations

from rollout.serve.processes import (
    ServeProcess,
    free_port,
    rallyrl_command,
    serve_processes,
    start_serve,
    wait_healthy,
)

__all__ = ["ServeProcess", "free_port", "rallyrl_command", "serve_processes", "start_serve", "wait_healthy"]
