"""Start local ``rallyrl serve`` processes: each on a free loopback port (or a given one), started
in parallel, ready when ``/health`` answers, and stopped with its whole process group.

    with serve_processes(model_dir, log_dir, count=2) as servers:
        pool = EnginePool([s.url for s in servers])

The soak (``benchmarks/soak.py``) and the tests use it; each server's output goes to
``log_dir/serve-<port>.log``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServeProcess:
    """One ``rallyrl serve`` process and where its output goes."""

    url: str
    process: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL when it has not exited within ``timeout_s``."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def rallyrl_command() -> list[str]:
    """The ``rallyrl`` console script, or ``python -m cli`` where it is not installed."""
    exe = shutil.which("rallyrl")
    return [exe] if exe else [sys.executable, "-m", "cli"]


def wait_healthy(url: str, process: subprocess.Popen | None, log: Path | None, timeout_s: float = 90.0) -> None:
    """Return when ``url/health`` answers 200; RuntimeError (with the log) when the process exits
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}:\n{log.read_text() if log else ''}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:g} s:\n{log.read_text() if log else ''}")


def start_serve(model_dir: Path, log_dir: Path, port: int | None = None, *extra: str) -> ServeProcess:
    """Start one CPU server of ``model_dir`` (not waiting for it); ``extra`` are more ``rallyrl serve``
    flags. It runs in a session of its own, so that ``kill`` stops everything it started."""
    port = port or free_port()
    log = log_dir / f"serve-{port}.log"
    command = [*rallyrl_command(), "serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return ServeProcess(f"http://127.0.0.1:{port}", process, log)


@contextlib.contextmanager
def serve_processes(model_dir: Path, log_dir: Path, count: int = 1, *extra: str) -> Iterator[list[ServeProcess]]:
    """``count`` servers of ``model_dir``, started together, healthy on entry, stopped on exit."""
    servers = [start_serve(model_dir, log_dir, None, *extra) for _ in range(count)]
    try:
        for server in servers:
            wait_healthy(server.url, server.process, server.log)
        yield servers
    finally:
        for server in servers:
            server.stop()
