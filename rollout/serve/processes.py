"""Start local ``rallyrl serve`` processes: each on a free loopback port (or a given one), started
in parallel, ready when ``/health`` answers, and stopped with its whole process group.

    with serve_processes(model_dir, log_dir, count=2) as servers:
        pool = EnginePool([s.url for s in servers])

The soak (``benchmarks/soak.py``) and the tests use it; each server's output goes to
``log_dir/serve-<port>.log``.

Every server leads a session of its own: Ctrl-C in a terminal reaches only the program that started
it, whose ``finally`` stops it, and ``stop`` and ``kill`` signal its whole process group (the workers
vLLM and SGLang fork are in it). SIGTERM's default, ending the program on the spot, would leave the
servers running; so while a server started here runs, or inside ``stop_on_sigterm()`` (each
benchmark's ``main``), SIGTERM is handled as Ctrl-C and the same ``finally`` blocks run. A second
SIGTERM, or ``SIGTERM_WATCHDOG_S`` after the first, SIGKILLs their groups at once; at exit, any
server still running is stopped.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

STOP_GRACE_S = 15.0
"""How long a server has to exit after SIGTERM before its process group is SIGKILLed."""
SIGTERM_WATCHDOG_S = 60.0
"""After a SIGTERM, how long this process's own cleanup may take before its servers are SIGKILLed."""


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process left that is not a zombie (``/proc``; where there
    is none, whether the group exists at all)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for name in entries:
        if name.isdigit():
            try:
                stat = Path("/proc", name, "stat").read_text()
            except OSError:  # (gone meanwhile)
                continue
            state, _, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == pgid and state not in ("Z", "X"):
                return True
    return False


@dataclass
class ServeProcess:
    """One server process (the leader of its own process group) and where its output goes."""

    url: str
    process: subprocess.Popen
    log: Path

    def __post_init__(self) -> None:
        _guard.track(self)

    def running(self) -> bool:
        """Whether the process, or any process of its group (the workers it forked), is alive."""
        return self.process.poll() is None or group_alive(self.process.pid)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL to the whole group, as a crash would."""
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        _guard.forget(self)

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, then SIGKILL when a process of it is left after ``timeout_s``."""
        stop_servers([self], timeout_s)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def stop_servers(servers: Iterable[ServeProcess], timeout_s: float = STOP_GRACE_S) -> None:
    """Stop ``servers`` together: SIGTERM to each one's process group, then SIGKILL to the groups
    that still have a process after ``timeout_s``."""
    servers = list(servers)
    for server in servers:
        if server.running():
            server.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(server.running() for server in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for server in servers:
        if server.running():
            server.kill()
        _guard.forget(server)


class _SigtermGuard:
    """The servers this process started and has not stopped, and SIGTERM handled as Ctrl-C while
    there are some or ``holds`` (``stop_on_sigterm``) is above 0."""

    def __init__(self) -> None:
        self.running: dict[int, ServeProcess] = {}
        self.holds = 0
        self.installed = False
        self.terminated = False
        self.stops_at_exit = False

    def track(self, server: ServeProcess) -> None:
        self.running[server.process.pid] = server
        if not self.stops_at_exit:
            atexit.register(self.stop_all)
            self.stops_at_exit = True
        self.sync()

    def forget(self, server: ServeProcess) -> None:
        self.running.pop(server.process.pid, None)
        self.sync()

    def sync(self) -> None:
        """Handle SIGTERM exactly while held or while a server runs; only over SIGTERM's default (a
        handler of the program's own stays), and only in the main thread (where Python runs handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        wanted = self.holds > 0 or bool(self.running)
        if wanted and not self.installed and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self.on_sigterm)
            self.installed = True
        elif self.installed and not wanted:
            if signal.getsignal(signal.SIGTERM) == self.on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.installed = False

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """The first SIGTERM is Ctrl-C: SIGINT's handler is called (Python's raises KeyboardInterrupt;
        ``asyncio.run``'s cancels its main task, which raises KeyboardInterrupt once cancelled)."""
        if self.terminated:  # again: the servers get no more time
            self.kill_all()
            raise KeyboardInterrupt
        self.terminated = True
        keep_interrupt_exit_status()
        threading.Thread(target=self.watchdog, name="sigterm-watchdog", daemon=True).start()
        interrupt = signal.getsignal(signal.SIGINT)
        if not callable(interrupt):  # (SIGINT ignored, as in a background job of a script)
            raise KeyboardInterrupt
        interrupt(signal.SIGINT, frame)

    def watchdog(self) -> None:
        time.sleep(SIGTERM_WATCHDOG_S)
        self.kill_all()

    def kill_all(self) -> None:
        for server in list(self.running.values()):
            server.signal(signal.SIGKILL)

    def stop_all(self) -> None:
        """At exit: whatever is still running (a path that did not stop its servers) is stopped."""
        stop_servers([s for s in list(self.running.values()) if s.running()], timeout_s=5.0)


_guard = _SigtermGuard()


def keep_interrupt_exit_status() -> None:
    """Let a program ended by KeyboardInterrupt die of SIGINT, as its parent expects. CPython 3.11 forgets
    that status when a string is ``exec``-ed at exit (namedtuple does, in an import), and torch's dynamo
    imports ``tabulate`` (installed with reasoning-gym) in an atexit hook only to log compile times at INFO."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is not None and callable(getattr(dynamo, "dump_compile_times", None)):
        atexit.unregister(dynamo.dump_compile_times)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM is handled as Ctrl-C (see the module's docstring), so that a program stopped
    by ``kill`` or a scheduler stops the servers and other processes it started on its way out.
    Also a decorator: ``@stop_on_sigterm()``."""
    _guard.holds += 1
    _guard.sync()
    try:
        yield
    finally:
        _guard.holds -= 1
        _guard.sync()


def rallyrl_command() -> list[str]:
    """The ``rallyrl`` console script, or ``python -m cli`` where it is not installed."""
    exe = shutil.which("rallyrl")
    return [exe] if exe else [sys.executable, "-m", "cli"]


def wait_healthy(url: str, process: subprocess.Popen | None, log: Path | None, timeout_s: float = 90.0) -> None:
    """Return when ``url/health`` answers 200; RuntimeError (with the log) when the process exits
    first or ``timeout_s`` passes (a server that accepts and never answers included)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}:\n{log.read_text() if log else ''}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=min(2.0, left)) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
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
def serve_processes(model_dir: Path, log_dir: Path, count: int = 1, *extra: str,
                    ready_timeout_s: float = 90.0) -> Iterator[list[ServeProcess]]:  # fmt: skip
    """``count`` servers of ``model_dir``, started together, healthy on entry (each within
    ``ready_timeout_s``), stopped on exit."""
    servers: list[ServeProcess] = []
    try:
        for _ in range(count):
            servers.append(start_serve(model_dir, log_dir, None, *extra))
        for server in servers:
            wait_healthy(server.url, server.process, server.log, ready_timeout_s)
        yield servers
    finally:
        stop_servers(servers)
