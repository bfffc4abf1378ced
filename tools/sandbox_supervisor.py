"""The sandbox's supervisor: one process per ``python`` tool call, started by the tool with
``python -I -S -B -c LAUNCH`` (``tools.python_sandbox.SUPERVISOR_LAUNCH``), which calls ``main``.

Standard library only (it runs isolated, before anything of rallyrl but ``tools`` is importable).
It becomes a child subreaper, starts ``init`` (pid 1 of a new PID namespace where the kernel
allows), which sets up mounts, limits, the user and Landlock (``tools.sandbox_kernel``) and
executes the program; it enforces the wall clock and kills and reaps every descendant before it
exits. The mechanisms and their fallbacks are described in ``tools/python_sandbox.py``; the seccomp
filter is ``tools.sandbox_seccomp``, the program's first code ``tools.sandbox_bootstrap``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
from typing import Any

from tools import sandbox_kernel as kernel
from tools import sandbox_seccomp as seccomp

SANDBOX_UIDS = range(1 << 30, (1 << 30) + (1 << 24))
"""As root, each call runs as a uid (and the same gid) drawn from here: no file or process on the
machine has it, and RLIMIT_NPROC counts that call's processes alone."""
FALLBACK_UID = 65534
"""nobody: used when the drawn uid is not mapped (a user-namespaced container maps fewer uids)."""
RUN_ENV = "RALLYRL_SANDBOX_RUN"
"""Environment variable carrying the call's run id in every sandbox process (for leftover scans)."""
SETUP_TIMEOUT_S = 15.0
"""Most seconds from the supervisor's start to the program's start (namespaces, mounts, exec)."""
WATCHDOG_INTERVAL_S = 0.01
"""How often the supervisor counts processes when RLIMIT_NPROC cannot do it."""

SYSTEM_READ_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/opt", "/sys")
"""Readable under Landlock besides the interpreter's paths, the working directory, /dev and /proc/self
(all of /proc when it is private): not /root, /home, /tmp, /var, /run, /srv, /mnt or the repository.
Also the only top-level directories of the host a mount namespace leaves visible (with /dev, /proc)."""
OPTIONAL_MECHANISMS = ("userns", "pidns", "netns", "mntns", "setuid", "landlock", "seccomp", "cgroup")
"""Mechanisms the ``disable`` config key can turn off (the subreaper and rlimits always apply);
``netns`` turns off the IPC namespace with the network namespace."""
OOM_SCORE_ADJ = 1000
"""The program's /proc/self/oom_score_adj: on any out-of-memory, in its cgroup or on the whole
machine, the kernel kills the sandbox's processes before the trainer's."""


class _Stop(Exception):
    """SIGTERM reached the supervisor: the tool wants the program stopped (cancelled call, output flood)."""


def _raise_stop(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop


def _send(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc; a process that forks meanwhile may be missed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _kill_descendants() -> None:
    """SIGKILL every descendant and reap until no child is left. As a subreaper we inherit every
    orphan, so "no child" means "no descendant": nothing of the call survives this."""
    me = os.getpid()
    while True:
        for pid in _descendants(me):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)


def _exec_program(
    cfg: dict[str, Any],
    err: int,
    *,
    uid: int | None,
    uncapable: bool,
    nproc: bool,
    landlock: int,
    shm: bool,
    netns: bool,
    own_proc: bool,
    filtered: bool,
):
    """The program's process: limits, identity, restrictions, then exec the interpreter. Never returns;
    a failure before exec is written to ``err`` (close-on-exec, so exec success closes it empty)."""
    try:
        os.setsid()
        mib = 1 << 20
        limits = {
            resource.RLIMIT_CORE: (0, 0),
            resource.RLIMIT_CPU: (cfg["cpu_s"], cfg["cpu_s"] + 1),  # SIGXCPU, then SIGKILL a second later
            resource.RLIMIT_AS: (cfg["memory_mb"] * mib,) * 2,
            resource.RLIMIT_FSIZE: (cfg["file_size_mb"] * mib,) * 2,
            resource.RLIMIT_NOFILE: (cfg["max_open_files"],) * 2,
        }
        if nproc:
            limits[resource.RLIMIT_NPROC] = (cfg["max_processes"],) * 2
        for which, value in limits.items():
            resource.setrlimit(which, value)
        os.chdir(cfg["workdir"])
        if uid is not None:
            kernel.switch_user(uid, uid)
        kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        kernel.prctl(kernel.PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary gives privileges back
        if uncapable:
            kernel.drop_capabilities()
        if landlock:
            readable = [*SYSTEM_READ_DIRS, *cfg["essential_paths"], *cfg["optional_paths"]]
            readable.append("/proc" if own_proc else "/proc/self")  # /proc/self: this process's entry only
            kernel.landlock_restrict(landlock, cfg["workdir"], readable, shm)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.closerange(3, err)
        os.closerange(err + 1, 4096)  # the supervisor opens only a handful
        if filtered:
            seccomp.install(network=netns)  # last: no Unix sockets, keys or user namespaces from here on
        mode = "network-namespace" if netns else "block-sockets"
        argv = [cfg["python"], "-I", "-B", "-u", "-c", cfg["bootstrap"], mode]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(err, f"{type(exc).__name__}: {exc}".encode())
    os._exit(127)


def _enter_cgroup(cfg: dict[str, Any], cgroup_fds: list[int]) -> tuple[list[str], bool]:
    """Move this process (init, before it starts anything) into the call's cgroup through the
    ``cgroup.procs`` files the supervisor opened. Returns (mechanisms, whether pids.max binds)."""
    try:
        if not cgroup_fds:
            raise OSError("no writable memory cgroup" if "cgroup" not in cfg["disable"] else "disabled")
        for fd in cgroup_fds:
            os.write(fd, b"0")  # 0: the writing process
    except OSError as exc:
        return [f"memory-per-process ({exc})"], False
    finally:
        for fd in cgroup_fds:
            os.close(fd)
    return list(cfg["cgroup_mechanisms"]), any(item.endswith("-pids") for item in cfg["cgroup_mechanisms"])


def _init(
    cfg: dict[str, Any], to_supervisor: int, supervisor_pid: int, pidns: bool, userns: bool, cgroup_fds: list[int]
) -> None:
    """The program's parent (pid 1 of the PID namespace when there is one): moves into the call's
    cgroup, sets up the rest of the sandbox, starts the program, reports the mechanisms in use and,
    later, the program's exit."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)  # the supervisor's death takes the whole sandbox down
    if os.getppid() != (0 if pidns else supervisor_pid):
        os._exit(1)  # the supervisor died before prctl
    cgroup, pids_bound = _enter_cgroup(cfg, cgroup_fds)
    disabled, root = set(cfg["disable"]), os.geteuid() == 0
    mechanisms = ["subreaper", "rlimits", *(["userns"] if userns else []), *(["pidns"] if pidns else []), *cgroup]
    mechanisms += [kernel.set_oom_score_adj(OOM_SCORE_ADJ), kernel.fresh_session_keyring()]  # inherited; before mounts
    mntns = netns = False
    if (root or userns) and "mntns" not in disabled:
        outer = os.readlink("/proc/self/ns/mnt")
        with contextlib.suppress(OSError):
            kernel.unshare(kernel.CLONE_NEWNS)
            mntns = os.readlink("/proc/self/ns/mnt") != outer  # never mount anything in the host's namespace
    if (root or userns) and "netns" not in disabled:
        with contextlib.suppress(OSError):
            kernel.unshare(kernel.CLONE_NEWNET)
            netns = True
        with contextlib.suppress(OSError):
            kernel.unshare(kernel.CLONE_NEWIPC)  # System V IPC and POSIX message queues of its own
            mechanisms.append("ipcns")
    uid = None
    if root and "setuid" not in disabled:
        for candidate in cfg["uids"]:
            if (problem := kernel.probe_as(candidate, [])) is None:
                uid = candidate
                break
        else:
            mechanisms.append(f"no-setuid ({problem})")
    shm = False
    if mntns:
        try:
            notes, shm = kernel.setup_mounts(cfg, pidns, uid, list(SYSTEM_READ_DIRS))
            mechanisms += ["mntns", *notes]
        except OSError as exc:
            mechanisms.append(f"mntns (setup incomplete: {exc})")
    if netns:
        mechanisms.append("netns")
    if uid is not None and (problem := kernel.probe_as(uid, cfg["essential_paths"])):
        uid = None
        mechanisms.append(f"no-setuid ({problem})")
    if uid is not None:
        mechanisms.append("setuid:own-uid" if uid in SANDBOX_UIDS else f"setuid:{uid}")
    for path in (cfg["workdir"], os.path.join(cfg["workdir"], "main.py")):  # the program's own
        os.chown(path, os.geteuid() if uid is None else uid, os.getegid() if uid is None else uid)
    uncapable = root and uid is None and "setuid" not in disabled
    if uncapable:
        mechanisms.append("root-without-capabilities")
    nproc = uid is not None or userns  # RLIMIT_NPROC binds neither root nor, usefully, a uid with other processes
    if nproc or not pids_bound:
        mechanisms.append("nproc" if nproc else "watchdog")
    landlock = kernel.landlock_abi() if "landlock" not in disabled else 0
    if landlock:
        mechanisms.append(f"landlock:v{landlock}")
    problem = "disabled" if "seccomp" in disabled else seccomp.unsupported()
    filtered = problem is None
    mechanisms += seccomp.MECHANISMS if filtered else [f"no-seccomp ({problem})"]
    network = "+".join(["seccomp"] * filtered + ["landlock-tcp"] * (landlock >= 4) + ["socket-patch"])
    network = "netns" if netns else network
    private_dirs = any(item.startswith("private-dirs") for item in mechanisms)
    if not filtered:  # abstract sockets: the network namespace or Landlock 6+ separate them
        abstract = netns or landlock >= 6
        mechanisms.append("unix-ipc-partly-open" if private_dirs and abstract else "unix-ipc-open")
        mechanisms += seccomp.GAPS
    exec_roots = [*SYSTEM_READ_DIRS, *cfg["essential_paths"], *cfg["optional_paths"]]  # Landlock lets these execute
    fenced = landlock and not any(cfg["workdir"].startswith(root.rstrip("/") + "/") for root in exec_roots)
    if not (filtered and (fenced or "noexec-tmpfs" in mechanisms)):
        mechanisms.append("comm-open")  # a process can get a name of the program's choosing (the kernel logs it)
    ipc = "+".join(["seccomp"] * filtered + ["private-dirs"] * private_dirs) or "open"
    err_read, err_write = os.pipe2(os.O_CLOEXEC)
    program = os.fork()
    if program == 0:
        own_proc = "private-proc" in mechanisms
        _exec_program(
            cfg,
            err_write,
            uid=uid,
            uncapable=uncapable,
            nproc=nproc,
            landlock=landlock,
            shm=shm,
            netns=netns,
            own_proc=own_proc,
            filtered=filtered,
        )
    os.close(err_write)
    failure = b""
    while chunk := os.read(err_read, 4096):
        failure += chunk
    if failure:
        os.waitpid(program, 0)
        _send(to_supervisor, {"event": "error", "message": f"could not start the program: {failure.decode()}"})
        return
    started = {"event": "started", "mechanisms": mechanisms, "network": network, "ipc": ipc}
    _send(to_supervisor, {**started, "nproc": nproc or pids_bound})
    while True:  # as pid 1, also reap orphans until the program itself exits
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            _send(to_supervisor, {"event": "exited", "status": status, "cpu_s": usage.ru_utime + usage.ru_stime})
            return  # exiting pid 1 makes the kernel kill what is left in the namespace


def _watch(cfg: dict[str, Any], report: dict[str, Any], init_pid: int, from_init: int) -> None:
    """Wait for init to finish, enforcing the wall clock (and the process count when needed). Init's
    end of the pipe closes when it exits (the program closed its copy before exec)."""
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    started = watchdog = False
    pending = b""
    while True:
        now = time.monotonic()
        if now >= deadline:
            report["reason"] = "timeout" if started else "setup-timeout"
            return
        wait = min(deadline - now, WATCHDOG_INTERVAL_S) if watchdog else deadline - now
        if select.select([from_init], [], [], wait)[0]:
            data = os.read(from_init, 65536)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                message = json.loads(line)
                if message["event"] == "started":
                    started, deadline = True, time.monotonic() + cfg["timeout_s"]
                    watchdog = not message["nproc"]
                    report.update(mechanisms=message["mechanisms"], network=message["network"], ipc=message["ipc"])
                elif message["event"] == "exited":
                    report.update(status=message["status"], cpu_s=message["cpu_s"])
                else:
                    report["error"] = message["message"]
            if not data:
                os.waitpid(init_pid, 0)
                if report["status"] is None and report["error"] is None:
                    report["reason"] = "monitor-killed"
                return
        if watchdog and started and len(_descendants(os.getpid())) > cfg["max_processes"] + 1:
            report["reason"] = "processes"
            return


def _supervise(cfg: dict[str, Any], report: dict[str, Any]) -> None:
    """Become a subreaper, enter new user/PID namespaces when possible, fork init and watch it."""
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGTERM)  # the tool's process died: stop everything (see _raise_stop)
    if os.getppid() != cfg["tool_pid"]:
        raise _Stop
    kernel.prctl(kernel.PR_SET_CHILD_SUBREAPER, 1)
    disabled, root = set(cfg["disable"]), os.geteuid() == 0
    cgroup_fds: list[int] = []  # opened before any namespace, with the tool's credentials
    try:
        for path in cfg["cgroup_procs"]:
            cgroup_fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError:
        for fd in cgroup_fds:
            os.close(fd)
        cgroup_fds = []
    userns = pidns = False
    if not root and "userns" not in disabled and kernel.user_namespace_works():
        kernel.enter_user_namespace()
        userns = True
    if (root or userns) and "pidns" not in disabled:
        with contextlib.suppress(OSError):
            kernel.unshare(kernel.CLONE_NEWPID)
            pidns = True
    from_init, to_supervisor = os.pipe()
    supervisor_pid = os.getpid()
    init_pid = os.fork()
    if init_pid == 0:
        try:
            os.close(from_init)
            os.close(cfg["report_fd"])
            _init(cfg, to_supervisor, supervisor_pid, pidns, userns, cgroup_fds)
        except BaseException as exc:
            message = f"sandbox setup failed: {type(exc).__name__}: {exc}"
            with contextlib.suppress(BaseException):
                _send(to_supervisor, {"event": "error", "message": message})
        os._exit(0)
    os.close(to_supervisor)
    for fd in cgroup_fds:
        os.close(fd)
    _watch(cfg, report, init_pid, from_init)


def main() -> None:
    """Entry point of the supervisor process: the JSON config is the rest of stdin (after the line the
    launch read), which then becomes /dev/null; the JSON report goes to ``report_fd``. Whatever
    happens, every descendant is dead and reaped before it exits."""
    cfg = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    report: dict[str, Any] = {"mechanisms": [], "network": None, "ipc": None, "status": None, "cpu_s": None}
    report.update(reason=None, error=None)
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        _supervise(cfg, report)
    except _Stop:
        report["reason"] = "stopped"
    except BaseException as exc:
        report["error"] = f"sandbox supervisor failed: {type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _kill_descendants()
        if os.getppid() != cfg["tool_pid"]:  # the tool died: nobody else will remove the directory
            shutil.rmtree(cfg["workdir"], ignore_errors=True)
        os.write(cfg["report_fd"], json.dumps(report).encode())
