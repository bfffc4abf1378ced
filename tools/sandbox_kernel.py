"""Linux primitives of the ``python`` tool's sandbox: namespaces, mounts, user switching,
capabilities and Landlock, through ctypes. Standard library only: the supervisor
(``tools/sandbox_supervisor.py``) imports it in a process started with ``python -I -S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import stat
import struct
from typing import Any

from tools.sandbox_seccomp import ARCHES as seccomp_arches  # the system call numbers, per machine

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x08000000
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
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # all arches
LANDLOCK_EXECUTE, LANDLOCK_WRITE_FILE, LANDLOCK_READ_FILE, LANDLOCK_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LANDLOCK_REFER, LANDLOCK_TRUNCATE = 1 << 13, 1 << 14
LANDLOCK_FILE_ACCESS = LANDLOCK_EXECUTE | LANDLOCK_WRITE_FILE | LANDLOCK_READ_FILE | LANDLOCK_TRUNCATE  # a file rule's
LANDLOCK_MAKE_AND_REMOVE = sum(1 << bit for bit in (4, 5, 6, 7, 8, 9, 10, 11, 12))  # REMOVE_DIR ... MAKE_SYM
LANDLOCK_NET_BIND_TCP, LANDLOCK_NET_CONNECT_TCP = 1 << 0, 1 << 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL = 1 << 0, 1 << 1

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_LIBC.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def unshare(flags: int) -> None:
    _check(_LIBC.unshare(ctypes.c_int(flags)), "unshare")


def prctl(option: int, value: int) -> None:
    _check(_LIBC.prctl(ctypes.c_int(option), ctypes.c_ulong(value), 0, 0, 0), "prctl")


def set_oom_score_adj(value: int) -> str:
    """Set this process's oom_score_adj (inherited by what it starts) and check it by reading it
    back. Returns the ``sandbox`` entry: ``oom-score-adj``, or why not."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))  # as root this also becomes the lowest value it may set
        with open("/proc/self/oom_score_adj") as f:
            found = int(f.read())
    except (OSError, ValueError) as exc:
        return f"no-oom-score-adj ({exc})"
    return "oom-score-adj" if found == value else f"no-oom-score-adj (reads {found})"


def fresh_session_keyring() -> str:
    """Join a new anonymous session keyring (inherited by what this process starts), leaving the one
    inherited from the trainer. Returns the ``sandbox`` entry: ``session-keyring``, or why not."""
    arch = seccomp_arches.get(os.uname().machine)
    if arch is None:
        return "no-session-keyring (unknown architecture)"
    number = arch[1]["keyctl"]
    result = _LIBC.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None)
    if result < 0:
        return f"no-session-keyring ({os.strerror(ctypes.get_errno())})"
    return "session-keyring"


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    _check(_LIBC.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


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


def switch_user(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def probe_as(uid: int, paths: list[str]) -> str | None:
    """Why the program cannot run as ``uid`` (None when it can), found by a throwaway child that
    switches to it and checks each of ``paths`` with access(2)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        problem = ""
        try:
            os.close(read)
            switch_user(uid, uid)
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


def _mount_points() -> list[tuple[str, str, str]]:
    """(mount point, per-mount options, filesystem type) of every mount in this mount namespace."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
            points.append((os.fsdecode(point), fields[5].decode(), fields[fields.index(b"-") + 1].decode()))
    return points


def naming_mounts() -> list[str]:
    """Mount points, as reached by their path, through which a process could get a name of its
    choosing: a proc mount that is not read-only (``/proc/<pid>/comm``), or a writable mount that
    is not noexec (a file written there executes under the name it was given). Every mount counts
    as writable but read-only ones, whatever its permissions."""
    found = []
    for point, _, fstype in _mount_points():
        try:
            flags = os.statvfs(point).f_flag  # the mount on top at that path: covered ones are out of reach
        except OSError:
            continue  # under a tmpfs that covers it: nothing there
        if not flags & os.ST_RDONLY and (fstype == "proc" or not flags & os.ST_NOEXEC):
            found.append(point)
    return found


def _remount_read_only(keep: set[str]) -> bool:
    """Remount every mount read-only except those at ``keep``; True when "/" became read-only."""
    root_done = False
    for point, options, _ in _mount_points():
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


def _cover(directory: str, keep: list[str]) -> None:
    """Mount an empty tmpfs over ``directory``, with bind mounts of just the paths in ``keep`` below it."""
    fds = {}
    try:
        for path in keep:
            with contextlib.suppress(OSError):
                fds[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for path, fd in fds.items():
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(path, 0o755)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    finally:
        for fd in fds.values():
            os.close(fd)


def hide_unlisted(visible: list[str], keep: list[str]) -> list[str]:
    """The program's view of the filesystem from an allowlist: every top-level directory not in
    ``visible`` (/tmp, /var, /run, /home, /root, /srv, /mnt, the repository ...) becomes an empty
    tmpfs holding only the paths in ``keep`` below it (the interpreter's, the working directory),
    and /dev/mqueue an empty one; a socket file in / or /dev is covered by /dev/null. No Unix socket
    of the host stays reachable but those in the visible system directories. Returns what it hid."""
    visible_set = {os.path.realpath(path) for path in visible} | {"/proc", "/dev", "/sys"}
    keep = sorted({os.path.realpath(path) for path in keep})
    keep = [path for path in keep if not any(path.startswith(other + "/") for other in keep)]
    hidden = []
    for directory in ("/", "/dev"):
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISSOCK(mode):
                _mount("/dev/null", path, None, MS_BIND)
                hidden.append(path)
            elif stat.S_ISDIR(mode) and directory == "/" and path not in visible_set and path not in keep:
                _cover(path, [kept for kept in keep if kept.startswith(path + "/")])
                hidden.append(path)
    if os.path.isdir("/dev/mqueue") and not os.path.islink("/dev/mqueue"):
        with contextlib.suppress(OSError):
            _mount("tmpfs", "/dev/mqueue", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=755")
            hidden.append("/dev/mqueue")
    return hidden


def setup_mounts(cfg: dict[str, Any], pidns: bool, uid: int | None, visible: list[str]) -> tuple[list[str], bool]:
    """Inside a fresh mount namespace: private propagation, only ``visible`` and the interpreter's
    paths left of the host's filesystem (``hide_unlisted``), the interpreter reachable for the
    sandbox uid, a writable working directory and a private /dev/shm (both noexec), a private /proc,
    the rest read-only; ``noexec-tmpfs`` when that leaves no mount where a process can be named
    (``naming_mounts``)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
    workdir, notes = cfg["workdir"], []
    with open(os.path.join(workdir, "main.py"), "rb") as f:
        program = f.read()
    needed = [*cfg["essential_paths"], *cfg["optional_paths"], workdir]
    hidden = hide_unlisted(visible, needed)
    notes.append("private-dirs:" + ",".join(path for path in hidden if path.count("/") == 1))
    if uid is not None:
        covered = _expose(needed, uid, uid)
        notes += [f"shadowed:{directory}" for directory in covered]
    uid, gid = (uid, uid) if uid is not None else (os.geteuid(), os.getegid())
    # a private, size-limited working directory (the host's stays empty but for main.py)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC  # what the program writes, it may read or import, never execute
    _mount("tmpfs", workdir, "tmpfs", flags, f"size={cfg['disk_mb']}m,mode=700,uid={uid},gid={gid}")
    with open(os.path.join(workdir, "main.py"), "wb") as f:
        f.write(program)
    os.chown(os.path.join(workdir, "main.py"), uid, gid)
    notes.append(f"tmpfs-workdir:{cfg['disk_mb']}m")
    keep = {workdir}
    shm = False
    if os.path.isdir("/dev/shm"):
        try:
            _mount("tmpfs", "/dev/shm", "tmpfs", flags, f"size={cfg['file_size_mb']}m,mode=1777")
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
    if not naming_mounts():
        notes.append("noexec-tmpfs")
    return notes, shm


def drop_capabilities() -> None:
    """For a program left running as root: empty the bounding, ambient and inheritable sets (and the
    rest), so that after exec it is uid 0 without a single capability: no reboot, no module loading,
    no raw devices, no overriding file permissions (files root owns stay its own, though)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for capability in range(last + 1):
        prctl(PR_CAPBSET_DROP, capability)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0)
    _check(_LIBC.capset(header, bytes(24)), "capset")  # effective, permitted, inheritable: all empty


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    version = _LIBC.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_long(0), ctypes.c_long(1))
    return max(int(version), 0)


def landlock_restrict(abi: int, workdir: str, readable: list[str], shm: bool) -> None:
    """Reads only below ``readable`` (and workdir), executing only below ``readable``, writes only below
    workdir (and /dev/shm when it is private) plus to existing /dev files; no TCP bind/connect (ABI
    4+), no signals to and no abstract sockets of processes outside the sandbox (ABI 6+)."""
    read = LANDLOCK_READ_FILE | LANDLOCK_READ_DIR
    write = LANDLOCK_WRITE_FILE | LANDLOCK_MAKE_AND_REMOVE
    write |= (LANDLOCK_REFER if abi >= 2 else 0) | (LANDLOCK_TRUNCATE if abi >= 3 else 0)
    net = LANDLOCK_NET_BIND_TCP | LANDLOCK_NET_CONNECT_TCP if abi >= 4 else 0
    scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", LANDLOCK_EXECUTE | read | write, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(
        _LIBC.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), attr, ctypes.c_long(len(attr)), ctypes.c_long(0)),
        "landlock_create_ruleset",
    )
    try:
        rules = [(path, LANDLOCK_EXECUTE | read) for path in readable] + [(workdir, read | write)]
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


def enter_user_namespace() -> None:
    """A new user namespace where we keep our uid and gid (and gain capabilities over its namespaces)."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def user_namespace_works() -> bool:
    """Try it in a throwaway child first: where unshare succeeds but the maps cannot be written (as
    under Ubuntu's AppArmor restriction), the supervisor must not enter one itself."""
    pid = os.fork()
    if pid == 0:
        try:
            enter_user_namespace()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0
