"""The sandbox's supervisor, run by the ``python`` tool as ``python -I -S sandbox_supervisor.py CONFIG``.

Standard library only (it runs isolated, before anything of rallyrl is importable). One
supervisor per call: it becomes a child subreaper, starts ``init`` (pid 1 of a new PID namespace
where the kernel allows), which sets up mounts, limits, the user and Landlock and executes the
program; it enforces the wall clock and kills and reaps every descendant before it exits.
The mechanisms and their fallbacks are described in ``tools/python_sandbox.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import time
from typing import Any

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

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, LINUX_CAPABILITY_VERSION_3 = 47, 4, 0x20080522
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MOUNT_OPTION_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # all arches
LANDLOCK_WRITE_FILE, LANDLOCK_READ_FILE, LANDLOCK_READ_DIR = 1 << 1, 1 << 2, 1 << 3
LANDLOCK_REFER, LANDLOCK_TRUNCATE = 1 << 13, 1 << 14
LANDLOCK_FILE_ACCESS = 1 << 0 | LANDLOCK_WRITE_FILE | LANDLOCK_READ_FILE | LANDLOCK_TRUNCATE  # rights a file rule takes
LANDLOCK_MAKE_AND_REMOVE = sum(1 << bit for bit in (4, 5, 6, 7, 8, 9, 10, 11, 12))  # REMOVE_DIR ... MAKE_SYM
LANDLOCK_NET_BIND_TCP, LANDLOCK_NET_CONNECT_TCP = 1 << 0, 1 << 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL = 1 << 0, 1 << 1
SYSTEM_READ_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/opt", "/sys")
"""Readable under Landlock besides the interpreter's paths, the working directory, /dev and /proc/self
(all of /proc when it is private): not /root, /home, /tmp, /var, /run, /srv, /mnt or the repository."""
OPTIONAL_MECHANISMS = ("userns", "pidns", "netns", "mntns", "setuid", "landlock")
"""Mechanisms the ``disable`` config key can turn off (the subreaper and rlimits always apply)."""

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_LIBC.syscall.restype = ctypes.c_long


class _Stop(Exception):
    """SIGTERM reached the supervisor: the tool wants the program stopped (cancelled call, output flood)."""


def _raise_stop(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _unshare(flags: int) -> None:
    _check(_LIBC.unshare(ctypes.c_int(flags)), "unshare")


def _prctl(option: int, value: int) -> None:
    _check(_LIBC.prctl(ctypes.c_int(option), ctypes.c_ulong(value), 0, 0, 0), "prctl")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    _check(_LIBC.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


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


def _allows(path: str, uid: int, gid: int, bits: int) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) has the rwx ``bits`` on ``path``."""
    st = os.stat(path)
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
    return (st.st_mode >> shift) & bits == bits


def _blocked_ancestors(path: str, uid: int, gid: int) -> list[tuple[str, str]]:
    """(directory, name of the next component) for each directory above ``path`` uid cannot search."""
    blocked, parent = [], "/"
    for name in path.strip("/").split("/"):
        if not _allows(parent, uid, gid, 1):
            blocked.append((parent, name))
        parent = os.path.join(parent, name)
    return blocked


def _switch_user(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def _probe_as(uid: int, paths: list[str]) -> str | None:
    """Why the program cannot run as ``uid`` (None when it can), found by a throwaway child that
    switches to it and checks each of ``paths`` with access(2)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        problem = ""
        try:
            os.close(read)
            _switch_user(uid, uid)
            for path in paths:
                if not os.access(path, os.X_OK if os.path.isfile(path) else os.R_OK | os.X_OK):
                    problem = f"{path} is not readable by uid {uid}"
                    break
        except BaseException as exc:
            problem = f"cannot switch to uid {uid}: {exc}"
        with contextlib.suppress(BaseException):
            os.write(write, problem.encode())
        os._exit(0)
    os.close(write)
    problem = b""
    while chunk := os.read(read, 4096):
        problem += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return problem.decode() or None


def _expose(paths: list[str], uid: int, gid: int) -> list[str]:
    """In our mount namespace, make ``paths`` reachable for uid: a directory it cannot search is
    covered by a tmpfs holding bind mounts of just the needed entries. Returns the covered dirs."""
    needed: dict[str, set[str]] = {}
    for path in paths:
        with contextlib.suppress(OSError):
            for directory, name in _blocked_ancestors(path, uid, gid):
                needed.setdefault(directory, set()).add(name)
    for directory in sorted(needed, key=lambda d: d.count("/")):  # outer first
        fds = {}
        for name in needed[directory]:
            with contextlib.suppress(OSError):
                fds[name] = os.open(os.path.join(directory, name), os.O_PATH | os.O_CLOEXEC)
        try:
            _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
            for name, fd in fds.items():
                target = os.path.join(directory, name)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(target)
                else:
                    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
                _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        finally:
            for fd in fds.values():
                os.close(fd)
    return sorted(needed)


def _mount_points() -> list[tuple[str, str]]:
    """(mount point, per-mount options) of every mount in this mount namespace."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
            points.append((os.fsdecode(point), fields[5].decode()))
    return points


def _remount_read_only(keep: set[str]) -> bool:
    """Remount every mount read-only except those at ``keep``; True when "/" became read-only."""
    root_done = False
    for point, options in _mount_points():
        if point in keep:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options.split(","):
            flags |= MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            _mount(None, point, None, flags)
            root_done = root_done or point == "/"
        except OSError:
            pass
    return root_done


def _setup_mounts(cfg: dict[str, Any], pidns: bool, uid: int | None) -> tuple[list[str], bool]:
    """Inside a fresh mount namespace: private propagation, the interpreter reachable for the
    sandbox uid, a writable working directory, a private /dev/shm and /proc, the rest read-only."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
    workdir, notes = cfg["workdir"], []
    if uid is not None:
        covered = _expose([*cfg["essential_paths"], *cfg["optional_paths"], workdir], uid, uid)
        notes += [f"shadowed:{directory}" for directory in covered]
    with open(os.path.join(workdir, "main.py"), "rb") as f:
        program = f.read()
    uid, gid = (uid, uid) if uid is not None else (os.geteuid(), os.getegid())
    # a private, size-limited working directory (the host's stays empty but for main.py)
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=700,uid={uid},gid={gid}")
    with open(os.path.join(workdir, "main.py"), "wb") as f:
        f.write(program)
    os.chown(os.path.join(workdir, "main.py"), uid, gid)
    notes.append(f"tmpfs-workdir:{cfg['disk_mb']}m")
    keep = {workdir}
    shm = False
    if os.path.isdir("/dev/shm"):
        try:
            _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['file_size_mb']}m,mode=1777")
            keep.add("/dev/shm")
            shm = True
        except OSError:
            pass
    if pidns:
        with contextlib.suppress(OSError):
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            notes.append("private-proc")
    if _remount_read_only(keep):
        notes.append("read-only-fs")
    return notes, shm


def _drop_capabilities() -> None:
    """For a program left running as root: empty the bounding, ambient and inheritable sets (and the
    rest), so that after exec it is uid 0 without a single capability: no reboot, no module loading,
    no raw devices, no overriding file permissions (files root owns stay its own, though)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for capability in range(last + 1):
        _prctl(PR_CAPBSET_DROP, capability)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0)
    _check(_LIBC.capset(header, bytes(24)), "capset")  # effective, permitted, inheritable: all empty


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    version = _LIBC.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_long(0), ctypes.c_long(1))
    return max(int(version), 0)


def _landlock_restrict(abi: int, workdir: str, readable: list[str], shm: bool) -> None:
    """Reads only below ``readable`` (and workdir), writes only below workdir (and /dev/shm when it is
    private) plus to existing /dev files; no TCP bind/connect (ABI 4+), no signals to and no abstract
    sockets of processes outside the sandbox (ABI 6+)."""
    read = LANDLOCK_READ_FILE | LANDLOCK_READ_DIR
    write = LANDLOCK_WRITE_FILE | LANDLOCK_MAKE_AND_REMOVE
    write |= (LANDLOCK_REFER if abi >= 2 else 0) | (LANDLOCK_TRUNCATE if abi >= 3 else 0)
    net = LANDLOCK_NET_BIND_TCP | LANDLOCK_NET_CONNECT_TCP if abi >= 4 else 0
    scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", read | write, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(
        _LIBC.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), attr, ctypes.c_long(len(attr)), ctypes.c_long(0)),
        "landlock_create_ruleset",
    )
    try:
        rules = [(path, read) for path in readable] + [(workdir, read | write)]
        rules.append(("/dev", read | LANDLOCK_WRITE_FILE | (LANDLOCK_TRUNCATE if abi >= 3 else 0)))
        if shm:
            rules.append(("/dev/shm", read | write))
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= LANDLOCK_FILE_ACCESS
                rule = struct.pack("=Qi", allowed, fd)  # struct landlock_path_beneath_attr (packed)
                add_rule = ctypes.c_long(SYS_LANDLOCK_ADD_RULE)
                _check(_LIBC.syscall(add_rule, ctypes.c_long(ruleset), ctypes.c_long(1), rule, 0), f"landlock {path}")
            finally:
                os.close(fd)
        _check(
            _LIBC.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_long(ruleset), ctypes.c_long(0)),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)


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
            _switch_user(uid, uid)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary gives privileges back
        if uncapable:
            _drop_capabilities()
        if landlock:
            readable = [*SYSTEM_READ_DIRS, *cfg["essential_paths"], *cfg["optional_paths"]]
            readable.append("/proc" if own_proc else "/proc/self")  # /proc/self: this process's entry only
            _landlock_restrict(landlock, cfg["workdir"], readable, shm)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.closerange(3, err)
        os.closerange(err + 1, 4096)  # the supervisor opens only a handful
        mode = "network-namespace" if netns else "block-sockets"
        argv = [cfg["python"], "-I", "-B", "-u", "-c", cfg["bootstrap"], mode]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(err, f"{type(exc).__name__}: {exc}".encode())
    os._exit(127)


def _init(cfg: dict[str, Any], to_supervisor: int, supervisor_pid: int, pidns: bool, userns: bool) -> None:
    """The program's parent (pid 1 of the PID namespace when there is one): sets up the rest of the
    sandbox, starts the program, reports the mechanisms in use and, later, the program's exit."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the supervisor's death takes the whole sandbox down
    if os.getppid() != (0 if pidns else supervisor_pid):
        os._exit(1)  # the supervisor died before prctl
    disabled, root = set(cfg["disable"]), os.geteuid() == 0
    mechanisms = ["subreaper", "rlimits", *(["userns"] if userns else []), *(["pidns"] if pidns else [])]
    mntns = netns = False
    if (root or userns) and "mntns" not in disabled:
        outer = os.readlink("/proc/self/ns/mnt")
        with contextlib.suppress(OSError):
            _unshare(CLONE_NEWNS)
            mntns = os.readlink("/proc/self/ns/mnt") != outer  # never mount anything in the host's namespace
    if (root or userns) and "netns" not in disabled:
        with contextlib.suppress(OSError):
            _unshare(CLONE_NEWNET)
            netns = True
    uid = None
    if root and "setuid" not in disabled:
        for candidate in cfg["uids"]:
            if (problem := _probe_as(candidate, [])) is None:
                uid = candidate
                break
        else:
            mechanisms.append(f"no-setuid ({problem})")
    shm = False
    if mntns:
        try:
            notes, shm = _setup_mounts(cfg, pidns, uid)
            mechanisms += ["mntns", *notes]
        except OSError as exc:
            mechanisms.append(f"mntns (setup incomplete: {exc})")
    if netns:
        mechanisms.append("netns")
    if uid is not None and (problem := _probe_as(uid, cfg["essential_paths"])):
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
    mechanisms.append("nproc" if nproc else "watchdog")
    landlock = _landlock_abi() if "landlock" not in disabled else 0
    if landlock:
        mechanisms.append(f"landlock:v{landlock}")
    network = "netns" if netns else "landlock-tcp+socket-patch" if landlock >= 4 else "socket-patch"
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
        )
    os.close(err_write)
    failure = b""
    while chunk := os.read(err_read, 4096):
        failure += chunk
    if failure:
        os.waitpid(program, 0)
        _send(to_supervisor, {"event": "error", "message": f"could not start the program: {failure.decode()}"})
        return
    _send(to_supervisor, {"event": "started", "mechanisms": mechanisms, "network": network, "nproc": nproc})
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
                    report.update(mechanisms=message["mechanisms"], network=message["network"])
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


def _enter_user_namespace() -> None:
    """A new user namespace where we keep our uid and gid (and gain capabilities over its namespaces)."""
    uid, gid = os.geteuid(), os.getegid()
    _unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _user_namespace_works() -> bool:
    """Try it in a throwaway child first: where unshare succeeds but the maps cannot be written (as
    under Ubuntu's AppArmor restriction), the supervisor must not enter one itself."""
    pid = os.fork()
    if pid == 0:
        try:
            _enter_user_namespace()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def _supervise(cfg: dict[str, Any], report: dict[str, Any]) -> None:
    """Become a subreaper, enter new user/PID namespaces when possible, fork init and watch it."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the tool's process died: stop everything (see _raise_stop)
    if os.getppid() != cfg["tool_pid"]:
        raise _Stop
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    disabled, root = set(cfg["disable"]), os.geteuid() == 0
    userns = pidns = False
    if not root and "userns" not in disabled and _user_namespace_works():
        _enter_user_namespace()
        userns = True
    if (root or userns) and "pidns" not in disabled:
        with contextlib.suppress(OSError):
            _unshare(CLONE_NEWPID)
            pidns = True
    from_init, to_supervisor = os.pipe()
    supervisor_pid = os.getpid()
    init_pid = os.fork()
    if init_pid == 0:
        try:
            os.close(from_init)
            os.close(cfg["report_fd"])
            _init(cfg, to_supervisor, supervisor_pid, pidns, userns)
        except BaseException as exc:
            message = f"sandbox setup failed: {type(exc).__name__}: {exc}"
            with contextlib.suppress(BaseException):
                _send(to_supervisor, {"event": "error", "message": message})
        os._exit(0)
    os.close(to_supervisor)
    _watch(cfg, report, init_pid, from_init)


def _supervisor_main() -> None:
    """Entry point of the supervisor process: ``argv[1]`` is the JSON config; the JSON report goes to
    ``report_fd``. Whatever happens, every descendant is dead and reaped before it exits."""
    cfg = json.loads(sys.argv[1])
    report: dict[str, Any] = {"mechanisms": [], "network": None, "status": None, "cpu_s": None}
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


def _run_user_program() -> None:
    """The program's first code (``python -I -B -u -c <this> <mode>``): refuse non-AF_UNIX sockets when
    there is no network namespace, then run main.py as ``__main__``; a traceback starts in main.py."""
    import builtins
    import sys
    import traceback

    import __main__

    if sys.argv[1:] == ["block-sockets"]:
        import _socket
        import socket

        def refuse() -> None:
            raise PermissionError(13, "network access is disabled in this sandbox")

        class GuardedSocket(_socket.socket):
            def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
                if fileno is None and family != _socket.AF_UNIX:
                    refuse()
                super().__init__(family, type, proto, fileno)

        socket_init = socket.socket.__init__

        def guarded_init(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family != socket.AF_UNIX:
                refuse()
            socket_init(self, family, type, proto, fileno)

        socket.socket.__init__ = guarded_init
        _socket.socket = _socket.SocketType = GuardedSocket
    sys.argv = ["main.py"]
    with open("main.py", "rb") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        sys.exit(1)
    namespace = __main__.__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __file__="main.py", __builtins__=builtins, __doc__=None)
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


if __name__ == "__main__":
    _supervisor_main()
