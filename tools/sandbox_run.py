"""One execution of the ``python`` tool's sandbox: start a supervisor for the program, capture its
output within a budget, stop it when asked, and make sure nothing of it is left afterwards.

``run_program`` is what ``PythonTool.execute`` awaits; what happens inside the supervisor is in
``tools/sandbox_supervisor.py`` (and the mechanisms are listed in ``tools/python_sandbox.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import inspect
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tools import sandbox_bootstrap as bootstrap
from tools import sandbox_cgroup as cgroups
from tools import sandbox_supervisor as supervisor

logger = logging.getLogger(__name__)

SUPERVISOR_GRACE_S = 20.0
"""Beyond timeout_s, how long the tool waits for the supervisor before killing it (a backstop)."""
SUPERVISOR_LAUNCH = (
    "import os, sys; sys.path.append(os.fsdecode(sys.stdin.buffer.readline()[:-1])); "
    "from tools.sandbox_supervisor import main; main()"
)
"""The supervisor's command, ``python -I -S -B -c LAUNCH``, with ``PACKAGE_ROOT``, a newline and the
JSON config on its stdin: nothing of the configuration (no host path) shows in its command line,
which is the sandbox's ``/proc/1/cmdline``. Isolated mode leaves every directory of ours off
``sys.path``, so the launch appends the one holding ``tools`` (after the standard library, which it
cannot shadow); the supervisor imports nothing else of ours."""
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(supervisor.__file__)))
"""The directory holding the ``tools`` package."""
READ_CHUNK = 1 << 20
"""Most bytes read from a program's stdout or stderr at once (and the pipes' size, where allowed)."""
UNPACED_READS, READ_INTERVAL_S = 16, 0.02
"""After its first UNPACED_READS reads, a stream is read at most once per READ_INTERVAL_S: the
program's output waits in the pipe meanwhile, so however it writes (a byte at a time, say), the
trainer's event loop wakes at most 1 / READ_INTERVAL_S times a second per stream."""


@functools.cache
def bootstrap_source() -> str:
    """The program's first code (``python -c``): ``tools/sandbox_bootstrap.py``'s ``_run_user_program``, then a call."""
    return inspect.getsource(bootstrap._run_user_program) + "\n_run_user_program()\n"


@functools.cache
def interpreter_paths() -> tuple[list[str], list[str]]:
    """(paths the program's interpreter cannot start without, the rest of its import path). The import
    path is asked of ``python -I`` itself, once: it is the program's, .pth files included, and holds
    neither our script's directory nor our working directory."""
    essential = {os.path.abspath(sys.executable), os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}
    essential |= {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    essential = {os.path.realpath(path) for path in essential if os.path.exists(path)}
    query = [sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"]
    try:
        import_path = json.loads(subprocess.run(query, capture_output=True, timeout=60, check=True).stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.warning("python tool: cannot read the interpreter's import path (%s); using the stdlib only", exc)
        import_path = []
    optional = {os.path.realpath(path) for path in import_path if path and os.path.isdir(path)}
    return sorted(essential), sorted(optional - essential - {"/"})


class OutputCapture:
    """One output stream: the first and last ``keep`` bytes and a byte count, whatever the volume."""

    def __init__(self, keep: int):
        self.keep, self.total = keep, 0
        self.head, self.tail = bytearray(), bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk[-self.keep :]
            del self.tail[: max(len(self.tail) - self.keep, 0)]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        middle = f"\n...[{cut} bytes of output cut]...\n".encode() if cut > 0 else b""
        return bytes(self.head + middle + self.tail).decode("utf-8", errors="replace")


@dataclass
class SandboxRun:
    """What one execution left: its output, the supervisor's report and the tool's own findings."""

    run_id: str
    stdout: OutputCapture
    stderr: OutputCapture
    report: dict[str, Any]
    flooded: bool = False
    backstop: bool = False
    wall_s: float = 0.0


def kill_marked(run_id: str) -> None:
    """Backstop when the supervisor did not finish cleanly: SIGKILL every process whose environment
    carries the call's run id, until none is left (a program can scrub that from its children)."""
    marker = f"{supervisor.RUN_ENV}={run_id}".encode()
    for _ in range(100):
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
        if not found:
            return
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


async def run_program(
    code: str, limits: dict[str, Any], *, max_output_chars: int, output_kill_bytes: int
) -> SandboxRun:
    """Run ``code`` under a supervisor with ``limits`` (the tool's timeout_s, cpu_s, memory_mb,
    file_size_mb, disk_mb, max_processes, max_open_files and disable), keeping ``max_output_chars``
    of each stream's head and tail and stopping the program past ``output_kill_bytes`` of output.
    Always kills what is left and removes the working directory and the call's cgroup."""
    await asyncio.to_thread(interpreter_paths)  # a subprocess on the first call, cached after
    started = time.monotonic()
    # the run id and the working directory name the process that started the run: leftovers say whose they are
    run_id = f"{os.getpid()}-{uuid.uuid4().hex}"
    workdir = os.path.realpath(tempfile.mkdtemp(prefix=f"rallyrl-python-{os.getpid()}-"))
    run = SandboxRun(run_id, OutputCapture(max_output_chars), OutputCapture(max_output_chars), {})
    proc: asyncio.subprocess.Process | None = None
    pumps: list[asyncio.Task[None]] = []
    report_read, report_write = os.pipe()  # the supervisor's JSON report comes back on this pipe
    (out_read, out_write), (err_read, err_write) = _output_pipe(), _output_pipe()
    group: cgroups.CallCgroup | None = None
    try:
        if "cgroup" not in limits["disable"]:
            group = await asyncio.to_thread(cgroups.create, run.run_id, limits["memory_mb"], limits["max_processes"])
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        config = json.dumps(_supervisor_config(limits, run, workdir, report_write, group))
        bin_dir = os.path.dirname(os.path.abspath(sys.executable))
        proc = await asyncio.create_subprocess_exec(  # argv[0] found on PATH: no host path in the command line
            *(os.path.basename(sys.executable), "-I", "-S", "-B", "-c", SUPERVISOR_LAUNCH),
            executable=sys.executable,
            stdin=asyncio.subprocess.PIPE,
            stdout=out_write,
            stderr=err_write,
            pass_fds=(report_write,),
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "LANG": "C.UTF-8", supervisor.RUN_ENV: run.run_id},
            start_new_session=True,
        )
        for fd in (report_write, out_write, err_write):
            os.close(fd)
        report_write = out_write = err_write = -1
        pumps = [
            asyncio.create_task(_pump(proc, out_read, run.stdout, run, output_kill_bytes)),
            asyncio.create_task(_pump(proc, err_read, run.stderr, run, output_kill_bytes)),
        ]
        assert proc.stdin is not None
        proc.stdin.write(os.fsencode(PACKAGE_ROOT) + b"\n" + config.encode())
        with contextlib.suppress(ConnectionError):  # it died at once: the report says why
            await proc.stdin.drain()
        proc.stdin.close()
        try:
            async with asyncio.timeout(limits["timeout_s"] + SUPERVISOR_GRACE_S):
                await proc.wait()
        except TimeoutError:
            run.backstop = True
    finally:
        for fd in (report_write, out_write, err_write):
            if fd >= 0:
                os.close(fd)
        if proc is not None and proc.returncode is None:
            await _stop(proc)  # cancelled, or the backstop fired
        await _finish(run, proc, pumps, report_read, (out_read, err_read), workdir, group)
        run.wall_s = time.monotonic() - started
    return run


def _output_pipe() -> tuple[int, int]:
    """A pipe for one of the program's streams: the read end non-blocking, as large as allowed."""
    read, write = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(read, False)
    with contextlib.suppress(OSError):
        fcntl.fcntl(read, fcntl.F_SETPIPE_SZ, READ_CHUNK)
    return read, write


def _supervisor_config(
    limits: dict[str, Any], run: SandboxRun, workdir: str, report_fd: int, group: cgroups.CallCgroup | None
) -> dict[str, Any]:
    essential, optional = interpreter_paths()  # cached by run_program
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        supervisor.RUN_ENV: run.run_id,
    }
    return {
        **limits,
        "python": os.path.abspath(sys.executable),
        "bootstrap": bootstrap_source(),
        "workdir": workdir,
        "env": env,
        "tool_pid": os.getpid(),
        "uids": [random.choice(supervisor.SANDBOX_UIDS), supervisor.FALLBACK_UID],
        "essential_paths": essential,
        "optional_paths": optional,
        "report_fd": report_fd,  # pass_fds keeps the number in the child
        "cgroup_procs": group.procs_files() if group else [],  # init moves itself in through these
        "cgroup_mechanisms": group.mechanisms if group else [],
    }


async def _readable(fd: int) -> None:
    """Wait until ``fd`` has data or its end (one wake-up of the event loop)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _pump(
    proc: asyncio.subprocess.Process, fd: int, capture: OutputCapture, run: SandboxRun, output_kill_bytes: int
) -> None:
    """Read a stream to its end in chunks of up to READ_CHUNK bytes, paced after UNPACED_READS (see
    READ_INTERVAL_S); past the output budget, stop the program (and keep draining)."""
    reads = 0
    while True:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            await _readable(fd)
            continue
        if not chunk:
            return
        capture.add(chunk)
        if not run.flooded and run.stdout.total + run.stderr.total > output_kill_bytes:
            run.flooded = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        reads += 1
        if reads >= UNPACED_READS:
            await asyncio.sleep(READ_INTERVAL_S)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ask the supervisor to kill the sandbox (SIGTERM); SIGKILL it if it does not exit in time."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(5):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


async def _finish(
    run: SandboxRun,
    proc: asyncio.subprocess.Process | None,
    pumps: list[asyncio.Task[None]],
    report_read: int,
    output_fds: tuple[int, ...],
    workdir: str,
    group: cgroups.CallCgroup | None,
) -> None:
    """Read the report, make sure nothing of the call is left, read the cgroup's memory peak and OOM
    kills and remove it, remove the working directory."""
    try:
        data = b""
        if proc is not None:
            os.set_blocking(report_read, False)
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(report_read, 65536):
                    data += chunk
        try:
            run.report = json.loads(data) if data else {}
        except ValueError:
            run.report = {}
        if proc is None or proc.returncode != 0 or not run.report:
            await asyncio.to_thread(kill_marked, run.run_id)  # the supervisor did not finish its job
        if pumps:
            _, late = await asyncio.wait(pumps, timeout=2.0)
            if late:  # something still holds the pipes: one more sweep, then give up reading
                await asyncio.to_thread(kill_marked, run.run_id)
                _, late = await asyncio.wait(late, timeout=2.0)
            for task in late:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    finally:
        for fd in (report_read, *output_fds):
            os.close(fd)
        run.report.update(memory_peak_mb=None, oom_killed=None)
        if group is not None:
            run.report.update(await asyncio.to_thread(group.stats))
            if not await asyncio.to_thread(group.remove):
                logger.warning("python tool: could not remove the call's cgroup %s", sorted(set(group.dirs.values())))
        await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)
