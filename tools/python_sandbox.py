"""A ``python`` tool: model-written Python runs in a sandboxed process tree, a fresh one per call.

    PythonTool.execute     asyncio, in the rollout process: caps output, bounds concurrency
                           (tools/sandbox_run.py makes the call's cgroup, tools/sandbox_cgroup.py,
                           starts the supervisor and cleans up after it)
      supervisor           python -I -S, tools/sandbox_supervisor.py: child subreaper,
                           wall clock; SIGKILLs and reaps every descendant before it exits
        init               pid 1 of a new PID namespace when the kernel allows: enters the
                           call's cgroup first, then mounts; reaps
          program          rlimits, own uid, no_new_privs, Landlock, seccomp, then python -I
                           main.py (the namespace, mount and Landlock calls: tools/sandbox_kernel.py;
                           the filter: tools/sandbox_seccomp.py; its first code: sandbox_bootstrap.py)

Each mechanism is tried at run time and used when the kernel and our privileges allow it;
``ToolResponse.metrics["sandbox"]`` lists what a call got (``PythonTool.sandbox``, the last call's):

- ``subreaper`` (always): orphans, a double-forked ``setsid`` daemon included, reparent to the
  supervisor, which SIGKILLs every descendant and reaps until it has no child left. It stops
  everything when the tool's process dies (PDEATHSIG) and init dies with it.
- ``pidns``: the program lives in its own PID namespace; when init exits or is killed, the kernel
  kills everything left in it. Without root, a ``userns`` (same uid inside) is created first.
- ``cgroup-v2-memory`` / ``cgroup-v1-memory`` (``-pids``, ``-cpu``): the call's processes are in a
  cgroup of their own: ``memory_mb`` bounds them all together, with the tmpfs pages they write
  (the working directory, /dev/shm), no swap; ``pids.max`` bounds their number; a CPU weight half a
  normal process's. The kernel's OOM kills are reported as an error, ``metrics["memory_peak_mb"]``
  and ``metrics["oom_killed"]`` say how much it used. Without a writable memory cgroup:
  ``memory-per-process``, RLIMIT_AS alone (``max_processes`` x ``memory_mb`` per call).
- ``mntns``: a private mount namespace: a size-limited tmpfs as the working directory
  (``tmpfs-workdir``), a private /dev/shm, a fresh /proc in the PID namespace (``private-proc``),
  every top-level directory but the system ones (/usr, /lib*, /bin, /sbin, /etc, /opt, /sys, /dev,
  /proc) an empty tmpfs holding only the interpreter's paths and the working directory
  (``private-dirs:/tmp,/run,/var,...``: no host Unix socket in them is reachable), an empty
  /dev/mqueue, socket files in / and /dev covered, and every mount read-only (``read-only-fs``);
  the working directory and /dev/shm noexec, so that with /proc read-only no mount is left where a
  process could be named by the program (``noexec-tmpfs``, see ``comm-open`` below).
- ``setuid``: as root, the program runs as a uid/gid of its own (SANDBOX_UIDS, else nobody), so
  RLIMIT_NPROC counts its processes alone and other users' files and processes are out of reach.
  Directories the interpreter needs but that uid cannot search (``/root`` for a pyenv Python) are
  shadowed in the mount namespace by a tmpfs holding only the interpreter's paths
  (``shadowed:/root``); when the interpreter stays unreachable the program runs as root.
- ``landlock``: reads only below SYSTEM_READ_DIRS, the interpreter's paths, the working directory
  and the program's own /proc entry; executes only below SYSTEM_READ_DIRS and the interpreter's
  paths; writes only below the working directory (and to existing files under /dev); no TCP
  bind/connect (ABI 4+); no signals to, and no abstract sockets of, processes outside the sandbox
  (ABI 6+).
- ``netns``: no network at all, and no abstract Unix socket of the host (``ipcns`` with it: System V
  IPC and POSIX message queues of its own). Otherwise seccomp refuses every socket (below); where
  seccomp is missing, sockets other than AF_UNIX are refused by the program's bootstrap
  (``socket-patch``: a speed bump only, ctypes or a subprocess get around it).
- ``seccomp:*`` (x86_64 and aarch64, ``tools/sandbox_seccomp.py``): ``no-unix-sockets``:
  ``socket(AF_UNIX)`` and io_uring are refused (EPERM), ``socketpair`` only for stream and seqpacket
  pairs: no IPC out of the sandbox whatever the filesystem shows; ``socket-allowlist``: TCP, UDP and
  NETLINK_ROUTE with a network namespace, no socket without one (no VSOCK, MPTCP, SCTP ...);
  ``no-keys``: no kernel keys; ``no-userns``: no user namespace made from inside; ``no-comm``: no
  ``prctl(PR_SET_NAME)``, symlink or ``fexecve``. ``metrics["ipc"]``
  says what holds (``seccomp+private-dirs``, ``seccomp``, ``private-dirs``, ``open``); without
  seccomp ``unix-ipc-open`` (or ``unix-ipc-partly-open`` when only the private directories and the
  namespace stand) is in the list and logged as a warning, with ``keys-open``, ``userns-open`` and
  ``socket-families-open``.
- ``comm-open`` unless seccomp and either ``noexec-tmpfs`` or Landlock hold: then a process of the
  program could get a name of its choosing (``prctl``, ``/proc/self/comm``, executing a file it
  named), which the kernel prints when the process segfaults or is OOM-killed.
- ``session-keyring`` (always tried): init joins a fresh anonymous session keyring, so the program
  does not inherit the trainer's. ``oom-score-adj`` (always tried): init sets 1000 before /proc is
  remounted read-only and reads it back; every process of the program inherits it.
- ``nproc`` when RLIMIT_NPROC binds (own uid, or a user namespace), else the cgroup's pids.max,
  else ``watchdog``: the supervisor counts descendants every 10 ms and kills the tree past
  ``max_processes``.
- ``rlimits`` (always): CPU seconds, address space, file size, open files, no core dumps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from data.text import truncate_middle
from tools import sandbox_supervisor as supervisor
from tools.base import BaseTool, ToolResponse, function_schema
from tools.sandbox_run import SandboxRun, run_program
from tools.sandbox_seccomp import GAPS as SECCOMP_GAPS

logger = logging.getLogger(__name__)

MIN_OUTPUT_KILL_BYTES = 1 << 20
"""A program is killed once it has written more than max(this, 100 * max_output_chars) bytes."""
LIMIT_KEYS = (
    "timeout_s", "cpu_s", "memory_mb", "file_size_mb", "disk_mb", "max_processes", "max_open_files", "disable",
)  # fmt: skip
"""The config keys the supervisor enforces (``run_program``'s ``limits``)."""


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
      memory_mb (1024): memory of the whole call: all its processes and the files it writes to its
        tmpfs directories (a cgroup), and address space per process (RLIMIT_AS; numpy/torch may
        need more); where no memory cgroup is writable, per process only (``memory-per-process``).
      file_size_mb (16): largest file the program may write (RLIMIT_FSIZE).
      disk_mb (256): size of the working directory, a tmpfs (in memory) when there is a mount
        namespace; without one only file_size_mb limits what the program writes there.
      max_processes (64): processes and threads of the program at once (RLIMIT_NPROC, or the
        supervisor's watchdog where that does not bind).
      max_open_files (256): RLIMIT_NOFILE.
      max_output_chars (4000): longest stdout + stderr returned (head and tail kept); a program
        writing more than max(1 MiB, 100 * this) bytes is killed.
      max_concurrent (4): programs running at once in this tool; further calls wait their turn.
      disable ([]): mechanisms not to use, from userns, pidns, netns, mntns, setuid, landlock,
        seccomp, cgroup (for testing the fallbacks; the strongest available ones are used otherwise).
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        known = {*LIMIT_KEYS, "max_output_chars", "max_concurrent"}
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
            limits = {name: getattr(self, name) for name in LIMIT_KEYS}
            run = await run_program(
                code, limits, max_output_chars=self.max_output_chars, output_kill_bytes=self.output_kill_bytes
            )
        return self._response(run)

    def _status(self, run: SandboxRun) -> str | None:
        """The ``Error: ...`` text for an execution that did not end with exit code 0."""
        report = run.report
        if run.flooded:
            return f"killed: the program wrote more than {self.output_kill_bytes} bytes of output"
        if run.backstop:
            return f"timed out after {self.timeout_s:g} s; the sandbox did not stop in time and was killed"
        if report.get("oom_killed"):
            return (
                f"killed: memory limit of {self.memory_mb} MB exceeded (all the program's processes and files "
                f"together); the kernel killed {report['oom_killed']} of its processes"
            )
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

    def _response(self, run: SandboxRun) -> ToolResponse:
        status = self._status(run)
        stdout, stderr = run.stdout.text(), run.stderr.text()
        budget = self.max_output_chars
        if stdout and stderr:  # share the budget; what one stream does not need goes to the other
            stdout = truncate_middle(stdout, max(budget // 2, budget - len(stderr)))
            stderr = truncate_middle(stderr, max(budget - len(stdout), budget // 2))
        parts = [truncate_middle(stdout, budget)] if stdout else []
        if stderr:
            parts.append(("[stderr]\n" if stdout else "") + truncate_middle(stderr, budget))
        if status is not None:
            parts.append(f"Error: {status}")
        text = "\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"
        if run.report.get("mechanisms") and run.report["mechanisms"] != self.sandbox:
            self.sandbox = list(run.report["mechanisms"])
            logger.info("python tool sandbox: %s; network: %s", self.sandbox, run.report.get("network"))
            gap_prefixes = ("unix-ipc-", "memory-per-process", *SECCOMP_GAPS, "comm-open")
            gaps = [item for item in self.sandbox if item.startswith((*gap_prefixes, "no-oom-score-adj"))]
            if gaps:
                logger.warning(
                    "python tool: sandbox gaps here: %s (unix-ipc: a program can connect to Unix sockets of this "
                    "machine; memory-per-process: memory_mb bounds each process, not the call; keys, user "
                    "namespaces, socket families, comm: see the README's sandbox table)",
                    gaps,
                )
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
            "ipc": run.report.get("ipc"),
            "memory_peak_mb": run.report.get("memory_peak_mb"),
            "oom_killed": run.report.get("oom_killed"),
            "run_id": run.run_id,
            "wall_s": round(run.wall_s, 3),
            "cpu_s": run.report.get("cpu_s"),
            "output_bytes": run.stdout.total + run.stderr.total,
        }
        return ToolResponse(text=text, metrics=metrics)
