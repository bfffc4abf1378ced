"""A ``python`` tool: model-written Python runs in a sandboxed process tree, a fresh one per call.

    PythonTool.execute     asyncio, in the rollout process: caps output, bounds concurrency
      supervisor           python -I -S tools/sandbox_supervisor.py: child subreaper,
                           wall clock; SIGKILLs and reaps every descendant before it exits
        init               pid 1 of a new PID namespace when the kernel allows: mounts, reaping
          program          rlimits, own uid, no_new_privs, Landlock, then python -I main.py

Each mechanism is tried at run time and used when the kernel and our privileges allow it;
``ToolResponse.metrics["sandbox"]`` lists what a call got (``PythonTool.sandbox``, the last call's):

- ``subreaper`` (always): orphans, a double-forked ``setsid`` daemon included, reparent to the
  supervisor, which SIGKILLs every descendant and reaps until it has no child left. It stops
  everything when the tool's process dies (PDEATHSIG) and init dies with it.
- ``pidns``: the program lives in its own PID namespace; when init exits or is killed, the kernel
  kills everything left in it. Without root, a ``userns`` (same uid inside) is created first.
- ``mntns``: a private mount namespace: a size-limited tmpfs as the working directory
  (``tmpfs-workdir``), a private /dev/shm, a fresh /proc in the PID namespace (``private-proc``),
  and every other mount read-only (``read-only-fs``).
- ``setuid``: as root, the program runs as a uid/gid of its own (SANDBOX_UIDS, else nobody), so
  RLIMIT_NPROC counts its processes alone and other users' files and processes are out of reach.
  Directories the interpreter needs but that uid cannot search (``/root`` for a pyenv Python) are
  shadowed in the mount namespace by a tmpfs holding only the interpreter's paths
  (``shadowed:/root``); when the interpreter stays unreachable the program runs as root.
- ``landlock``: reads only below SYSTEM_READ_DIRS, the interpreter's paths, the working directory
  and the program's own /proc entry; writes only below the working directory (and to existing
  files under /dev); no TCP bind/connect (ABI 4+); no signals to, and no abstract sockets of,
  processes outside the sandbox (ABI 6+).
- ``netns``: no network at all. Otherwise sockets other than AF_UNIX are refused by the program's
  bootstrap (``socket-patch``: a speed bump only, ctypes or a subprocess get around it).
- ``nproc`` when RLIMIT_NPROC binds (own uid, or a user namespace), else ``watchdog``: the
  supervisor counts descendants every 10 ms and kills the tree past ``max_processes``.
- ``rlimits`` (always): CPU seconds, address space, file size, open files, no core dumps.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from tools import sandbox_supervisor as supervisor
from tools.base import BaseTool, ToolResponse, function_schema

logger = logging.getLogger(__name__)

MIN_OUTPUT_KILL_BYTES = 1 << 20
"""A program is killed once it has written more than max(this, 100 * max_output_chars) bytes."""
SUPERVISOR_GRACE_S = 20.0
"""Beyond timeout_s, how long the tool waits for the supervisor before killing it (a backstop)."""


@functools.cache
def _bootstrap_source() -> str:
    return inspect.getsource(supervisor._run_user_program) + "\n_run_user_program()\n"


@functools.cache
def _interpreter_paths() -> tuple[list[str], list[str]]:
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


class _Capture:
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


def _truncate(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within about ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 0)
    head = keep - keep // 2
    return f"{text[:head]}\n...[{len(text) - keep} characters cut]...\n{text[len(text) - keep // 2 :]}"


def _kill_marked(run_id: str) -> None:
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


@dataclass
class _Run:
    """What one execution left: its output, the supervisor's report and the tool's own findings."""

    run_id: str
    stdout: _Capture
    stderr: _Capture
    report: dict[str, Any]
    flooded: bool = False
    backstop: bool = False
    wall_s: float = 0.0


def _config_number(config: dict[str, Any], key: str, default: float, integer: bool) -> Any:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"python tool config {key!r} must be {kind}, got {value!r}")
    return value


class PythonTool(BaseTool):
    """``python(code)``: run a Python 3 program in a sandbox; the model reads its stdout, its stderr and
    a last ``Error: ...`` line when it failed, timed out or was killed (see the module docstring).

    Config keys:
      timeout_s (10): wall-clock limit; the program and every process it started are killed.
      cpu_s (10): CPU seconds per process (RLIMIT_CPU).
      memory_mb (1024): address space per process (RLIMIT_AS); numpy/torch may need more.
      file_size_mb (16): largest file the program may write (RLIMIT_FSIZE).
      disk_mb (256): size of the working directory, a tmpfs (in memory) when there is a mount
        namespace; without one only file_size_mb limits what the program writes there.
      max_processes (64): processes and threads of the program at once (RLIMIT_NPROC, or the
        supervisor's watchdog where that does not bind).
      max_open_files (256): RLIMIT_NOFILE.
      max_output_chars (4000): longest stdout + stderr returned (head and tail kept); a program
        writing more than max(1 MiB, 100 * this) bytes is killed.
      max_concurrent (4): programs running at once in this tool; further calls wait their turn.
      disable ([]): mechanisms not to use, from userns, pidns, netns, mntns, setuid, landlock
        (for testing the fallbacks; the strongest available ones are used otherwise).
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        known = {"timeout_s", "cpu_s", "memory_mb", "file_size_mb", "disk_mb", "max_processes", "max_open_files"}
        known |= {"max_output_chars", "max_concurrent", "disable"}
        if unknown := sorted(set(self.config) - known):
            raise ValueError(f"python tool config: unknown key(s) {unknown}; known: {sorted(known)}")
        self.timeout_s: float = _config_number(self.config, "timeout_s", 10.0, integer=False)
        self.cpu_s: int = _config_number(self.config, "cpu_s", 10, integer=True)
        self.memory_mb: int = _config_number(self.config, "memory_mb", 1024, integer=True)
        self.file_size_mb: int = _config_number(self.config, "file_size_mb", 16, integer=True)
        self.max_processes: int = _config_number(self.config, "max_processes", 64, integer=True)
        self.max_open_files: int = _config_number(self.config, "max_open_files", 256, integer=True)
        self.disk_mb: int = _config_number(self.config, "disk_mb", 256, integer=True)
        self.max_output_chars: int = _config_number(self.config, "max_output_chars", 4000, integer=True)
        self.max_concurrent: int = _config_number(self.config, "max_concurrent", 4, integer=True)
        self.disable: list[str] = list(self.config.get("disable", []))
        if bad := sorted(set(self.disable) - set(supervisor.OPTIONAL_MECHANISMS)):
            raise ValueError(
                f"python tool config 'disable': unknown {bad}; choose from {list(supervisor.OPTIONAL_MECHANISMS)}"
            )
        if not sys.executable:
            raise ValueError("python tool: sys.executable is empty, no interpreter to run programs with")
        self.output_kill_bytes = max(MIN_OUTPUT_KILL_BYTES, 100 * self.max_output_chars)
        self.sandbox: list[str] = []
        """The mechanisms the last call ran under (empty before the first call)."""
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return function_schema(
            "python",
            "Run a Python 3 program in a sandbox: no network, a fresh empty working directory, limited time "
            "and memory. Returns what it prints (stdout, then stderr); print the results you need.",
            {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """Run ``parameters["code"]`` and describe the outcome; never raises for what the program does."""
        code = parameters.get("code")
        if not isinstance(code, str):
            message = "Error: python needs 'code', a string with a Python program"
            return ToolResponse(text=message, metrics={"error": True})
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrent), loop
        async with self._slots:
            await asyncio.to_thread(_interpreter_paths)  # a subprocess on the first call, cached after
            run = await self._run(code)
        return self._response(run)

    async def _run(self, code: str) -> _Run:
        """One execution: start the supervisor, pump its output, wait; always kill and clean up."""
        started = time.monotonic()
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="rallyrl-python-"))
        run = _Run(uuid.uuid4().hex, _Capture(self.max_output_chars), _Capture(self.max_output_chars), {})
        proc: asyncio.subprocess.Process | None = None
        pumps: list[asyncio.Task[None]] = []
        report_read, report_write = os.pipe()  # the supervisor's JSON report comes back on this pipe
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            config = json.dumps(self._supervisor_config(run, workdir, report_write))
            proc = await asyncio.create_subprocess_exec(
                *(sys.executable, "-I", "-S", "-B", supervisor.__file__, config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(report_write,),
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", supervisor.RUN_ENV: run.run_id},
                start_new_session=True,
            )
            os.close(report_write)
            report_write = -1
            pumps = [
                asyncio.create_task(self._pump(proc, proc.stdout, run.stdout, run)),
                asyncio.create_task(self._pump(proc, proc.stderr, run.stderr, run)),
            ]
            try:
                async with asyncio.timeout(self.timeout_s + SUPERVISOR_GRACE_S):
                    await proc.wait()
            except TimeoutError:
                run.backstop = True
        finally:
            if report_write >= 0:
                os.close(report_write)
            if proc is not None and proc.returncode is None:
                await self._stop(proc)  # cancelled, or the backstop fired
            await self._finish(run, proc, pumps, report_read, workdir)
            run.wall_s = time.monotonic() - started
        return run

    def _supervisor_config(self, run: _Run, workdir: str, report_fd: int) -> dict[str, Any]:
        essential, optional = _interpreter_paths()  # cached by execute's first call
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
            "python": os.path.abspath(sys.executable),
            "bootstrap": _bootstrap_source(),
            "workdir": workdir,
            "env": env,
            "timeout_s": self.timeout_s,
            "cpu_s": self.cpu_s,
            "memory_mb": self.memory_mb,
            "file_size_mb": self.file_size_mb,
            "max_processes": self.max_processes,
            "max_open_files": self.max_open_files,
            "disk_mb": self.disk_mb,
            "disable": self.disable,
            "tool_pid": os.getpid(),
            "uids": [random.choice(supervisor.SANDBOX_UIDS), supervisor.FALLBACK_UID],
            "essential_paths": essential,
            "optional_paths": optional,
            "report_fd": report_fd,  # pass_fds keeps the number in the child
        }

    async def _pump(
        self, proc: asyncio.subprocess.Process, stream: asyncio.StreamReader | None, capture: _Capture, run: _Run
    ) -> None:
        """Read a stream to its end in chunks; past the output budget, stop the program (keep draining)."""
        assert stream is not None
        while chunk := await stream.read(65536):
            capture.add(chunk)
            if not run.flooded and run.stdout.total + run.stderr.total > self.output_kill_bytes:
                run.flooded = True
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    @staticmethod
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
        self,
        run: _Run,
        proc: asyncio.subprocess.Process | None,
        pumps: list[asyncio.Task[None]],
        report_read: int,
        workdir: str,
    ) -> None:
        """Read the report, make sure nothing of the call is left, remove the working directory."""
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
                await asyncio.to_thread(_kill_marked, run.run_id)  # the supervisor did not finish its job
            if pumps:
                _, late = await asyncio.wait(pumps, timeout=2.0)
                if late:  # something still holds the pipes: one more sweep, then give up reading
                    await asyncio.to_thread(_kill_marked, run.run_id)
                    _, late = await asyncio.wait(late, timeout=2.0)
                for task in late:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            os.close(report_read)
            await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)

    def _status(self, run: _Run) -> str | None:
        """The ``Error: ...`` text for an execution that did not end with exit code 0."""
        report = run.report
        if run.flooded:
            return f"killed: the program wrote more than {self.output_kill_bytes} bytes of output"
        if run.backstop:
            return f"timed out after {self.timeout_s:g} s; the sandbox did not stop in time and was killed"
        if report.get("reason") == "timeout":
            return f"timed out after {self.timeout_s:g} s; the program and all its processes were killed"
        if report.get("reason") == "processes":
            return f"killed: more than {self.max_processes} processes at once; all were killed"
        if report.get("error"):
            return str(report["error"])
        if report.get("reason") == "setup-timeout":
            return f"the sandbox did not start within {supervisor.SETUP_TIMEOUT_S:g} s"
        if report.get("reason") == "monitor-killed":
            return "killed: the program killed the sandbox's monitor process; all its processes were killed"
        status = report.get("status")
        if status is None:
            return "the sandbox stopped without reporting how the program ended"
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            cpu_s = report.get("cpu_s") or 0.0
            if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_s >= self.cpu_s - 0.1):
                return f"killed: CPU time limit of {self.cpu_s} s"
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = str(signum)
            hint = " (a crash: often a stack overflow from deep recursion, or the memory limit)"
            return f"killed by signal {name}" + (hint if signum in (signal.SIGSEGV, signal.SIGBUS) else "")
        code = os.WEXITSTATUS(status)
        if code == 0:
            return None
        tail = run.stderr.text().rstrip().rsplit("\n", 1)[-1]
        if tail.startswith("MemoryError"):
            return f"exit code {code}: out of memory (MemoryError; the memory limit is {self.memory_mb} MB)"
        return f"exit code {code}"

    def _response(self, run: _Run) -> ToolResponse:
        status = self._status(run)
        stdout, stderr = run.stdout.text(), run.stderr.text()
        budget = self.max_output_chars
        if stdout and stderr:  # share the budget; what one stream does not need goes to the other
            stdout = _truncate(stdout, max(budget // 2, budget - len(stderr)))
            stderr = _truncate(stderr, max(budget - len(stdout), budget // 2))
        parts = [_truncate(stdout, budget)] if stdout else []
        if stderr:
            parts.append(("[stderr]\n" if stdout else "") + _truncate(stderr, budget))
        if status is not None:
            parts.append(f"Error: {status}")
        text = "\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"
        if run.report.get("mechanisms") and run.report["mechanisms"] != self.sandbox:
            self.sandbox = list(run.report["mechanisms"])
            logger.info("python tool sandbox: %s; network: %s", self.sandbox, run.report.get("network"))
            if not any(item.startswith(("setuid", "landlock", "read-only-fs")) for item in self.sandbox):
                logger.warning(
                    "python tool: programs run with this process's own uid and no filesystem restriction "
                    "(no setuid, Landlock or mount namespace available here); only the rlimits, the process "
                    "cleanup and the socket patch apply"
                )
        status_code = run.report.get("status")
        metrics = {
            "error": status is not None,
            "timed_out": run.report.get("reason") == "timeout" or run.backstop,
            "exit_code": os.WEXITSTATUS(status_code) if status_code is not None and os.WIFEXITED(status_code) else None,
            "sandbox": list(run.report.get("mechanisms") or []),
            "network": run.report.get("network"),
            "run_id": run.run_id,
            "wall_s": round(run.wall_s, 3),
            "cpu_s": run.report.get("cpu_s"),
            "output_bytes": run.stdout.total + run.stderr.total,
        }
        return ToolResponse(text=text, metrics=metrics)
