"""The ``python`` tool's seccomp filter, in the spirit of Docker's default profile: it refuses what
a Python tool never needs, through ctypes. Standard library only (the supervisor runs ``python -I -S``).

- ``socket``: an allow-list of families and protocols. With a network namespace of its own
  (``network=True``): AF_INET and AF_INET6 TCP (stream, protocol 0 or IPPROTO_TCP) and UDP (datagram,
  0 or IPPROTO_UDP), and AF_NETLINK's NETLINK_ROUTE (glibc reads the interfaces through it:
  ``getaddrinfo`` with AI_ADDRCONFIG, ``if_nameindex``); without one, no socket at all (the call has
  no network). Everything else is EPERM: AF_UNIX (a host Unix socket could be reached; seccomp
  cannot read ``connect``'s address), AF_VSOCK (no per-namespace port space), MPTCP and SCTP (past
  Landlock's TCP rules), raw and packet sockets, other netlink families (the host's device events).
- ``socketpair``: stream and seqpacket pairs only (asyncio and multiprocessing use them; they reach
  nothing outside the process tree), EPERM for datagram pairs, which can ``connect`` anew.
- ``io_uring_setup``/``enter``/``register``: EPERM (io_uring creates sockets without ``socket``).
- ``keyctl``, ``add_key``, ``request_key``: EPERM. Keys are in no namespace: a program could read the
  session keyring it inherits or leave keys behind for a later call.
- ``unshare`` and ``clone`` with CLONE_NEWUSER: EPERM; ``clone3``: ENOSYS, so that glibc and Python
  fall back to ``clone``, whose flags the filter can read. In a user namespace of its own a program
  could make a network namespace whose socket buffers no cgroup v1 charges.
- ``prctl(PR_SET_NAME)``, ``symlink``/``symlinkat`` and ``execveat`` with AT_EMPTY_PATH: EPERM. The
  kernel logs a process's name (its comm) when it segfaults or is OOM-killed; with these refused,
  and the writable directories noexec (or Landlock allowing execution only in the system
  directories), a process is named after a file that already exists where the program cannot
  write: ``execve`` takes the name from the path's last component, which a symlink to the
  interpreter would choose, and ``fexecve`` from the file (``memfd:<any name>``). Hard links stay
  (glibc's ``sem_open``, hence multiprocessing's locks, makes one): a link lives on its file's
  mount, so one the program can make is as unexecutable as the files it writes.
- a system call of another ABI (32-bit x86, x32): the process is killed.

Only x86_64 and aarch64 are known (by system call number); elsewhere ``unsupported`` says why
and no filter is installed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 21, 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
BPF_LD_W_ABS, BPF_ALU_AND_K, BPF_JEQ_K, BPF_JGE_K, BPF_JGT_K, BPF_JSET_K, BPF_RET_K = (
    0x20, 0x54, 0x15, 0x35, 0x25, 0x45, 0x06,
)  # fmt: skip
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 2, 5, 0xF
IPPROTO_TCP, IPPROTO_UDP, NETLINK_ROUTE = 6, 17, 0
CLONE_NEWUSER, PR_SET_NAME, AT_EMPTY_PATH = 0x10000000, 15, 0x1000
IO_URING_FIRST, IO_URING_LAST, NR_CLONE3 = 425, 427, 435  # the same numbers on every arch
X32_SYSCALL_BIT = 0x40000000
ARCHES = {  # machine: AUDIT_ARCH_*, and the system call numbers that differ
    "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "clone": 56, "unshare": 272, "add_key": 248,
                            "request_key": 249, "keyctl": 250, "prctl": 157, "execveat": 322, "symlink": 88,
                            "symlinkat": 266}),
    "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "clone": 220, "unshare": 97, "add_key": 217,
                             "request_key": 218, "keyctl": 219, "prctl": 167, "execveat": 281,
                             "symlinkat": 36}),
}  # fmt: skip
KEY_CALLS = ("add_key", "request_key", "keyctl")
SYMLINK_CALLS = ("symlink", "symlinkat")  # aarch64 has only symlinkat
MECHANISMS = (
    "seccomp:no-unix-sockets", "seccomp:socket-allowlist", "seccomp:no-keys", "seccomp:no-userns", "seccomp:no-comm",
)  # fmt: skip
"""What the filter closes, as ``metrics["sandbox"]`` names it."""
GAPS = ("keys-open", "userns-open", "socket-families-open")
"""What stays open without it (besides Unix-socket IPC, reported as ``unix-ipc-*``)."""

_LIBC = ctypes.CDLL(None, use_errno=True)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def unsupported() -> str | None:
    """Why no filter can be installed here (None when it can)."""
    machine = os.uname().machine
    if machine not in ARCHES or struct.calcsize("P") != 8 or sys.byteorder != "little":
        return f"no seccomp filter for this architecture ({machine}, {struct.calcsize('P') * 8}-bit {sys.byteorder})"
    if _LIBC.prctl(ctypes.c_int(PR_GET_SECCOMP), 0, 0, 0, 0) < 0:
        return f"seccomp unavailable: {os.strerror(ctypes.get_errno())}"
    return None


def _assemble(program: list[tuple]) -> list[tuple[int, int, int, int]]:
    """(label,) marks a position; (code, k, true_label, false_label) jumps (None: the next
    instruction); (code, k) does not."""
    labels, position = {}, 0
    for item in program:
        if len(item) == 1:
            labels[item[0]] = position
        else:
            position += 1
    out = []
    for item in (item for item in program if len(item) > 1):
        code, k, *targets = item
        jt, jf = (labels[t] - len(out) - 1 if t is not None else 0 for t in (targets or [None, None]))
        out.append((code, jt, jf, k))
    return out


def filter_program(network: bool) -> list[tuple[int, int, int, int]]:
    """The BPF program for this machine (see the module docstring); ``network``: the call has a
    network namespace of its own, where TCP and UDP sockets are allowed."""
    arch, numbers = ARCHES[os.uname().machine]
    deny, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    arg = 16  # offsetof(struct seccomp_data, args): nr (4), arch (4), instruction_pointer (8); low half first
    families = [(AF_INET, "inet"), (AF_INET6, "inet"), (AF_NETLINK, "netlink")] if network else []
    return _assemble(
        [
            (BPF_LD_W_ABS, 4),
            (BPF_JEQ_K, arch, None, "kill"),
            (BPF_LD_W_ABS, 0),
            (BPF_JGE_K, X32_SYSCALL_BIT, "kill", None),  # x32 numbers never appear on aarch64
            (BPF_JEQ_K, numbers["socket"], "socket", None),
            (BPF_JEQ_K, numbers["socketpair"], "socketpair", None),
            (BPF_JEQ_K, numbers["clone"], "flags", None),
            (BPF_JEQ_K, numbers["unshare"], "flags", None),
            *((BPF_JEQ_K, numbers[name], "deny", None) for name in (*KEY_CALLS, *SYMLINK_CALLS) if name in numbers),
            (BPF_JEQ_K, numbers["prctl"], "prctl", None),
            (BPF_JEQ_K, numbers["execveat"], "execveat", None),
            (BPF_JEQ_K, NR_CLONE3, "enosys", None),
            (BPF_JGE_K, IO_URING_FIRST, None, "allow"),
            (BPF_JGT_K, IO_URING_LAST, "allow", "deny"),
            ("flags",),  # clone's and unshare's first argument
            (BPF_LD_W_ABS, arg),
            (BPF_JSET_K, CLONE_NEWUSER, "deny", "allow"),
            ("prctl",),
            (BPF_LD_W_ABS, arg),  # option
            (BPF_JEQ_K, PR_SET_NAME, "deny", "allow"),
            ("execveat",),
            (BPF_LD_W_ABS, arg + 32),  # flags, the fifth argument
            (BPF_JSET_K, AT_EMPTY_PATH, "deny", "allow"),
            ("socket",),
            (BPF_LD_W_ABS, arg),  # domain
            *((BPF_JEQ_K, family, label, None) for family, label in families),
            (BPF_RET_K, deny),
            ("inet",),
            (BPF_LD_W_ABS, arg + 8),  # type, with SOCK_NONBLOCK / SOCK_CLOEXEC
            (BPF_ALU_AND_K, SOCK_TYPE_MASK),
            (BPF_JEQ_K, SOCK_STREAM, "stream", None),
            (BPF_JEQ_K, SOCK_DGRAM, "datagram", "deny"),
            ("stream",),
            (BPF_LD_W_ABS, arg + 16),  # protocol
            (BPF_JEQ_K, 0, "allow", None),
            (BPF_JEQ_K, IPPROTO_TCP, "allow", "deny"),
            ("datagram",),
            (BPF_LD_W_ABS, arg + 16),
            (BPF_JEQ_K, 0, "allow", None),
            (BPF_JEQ_K, IPPROTO_UDP, "allow", "deny"),
            ("netlink",),
            (BPF_LD_W_ABS, arg + 16),
            (BPF_JEQ_K, NETLINK_ROUTE, "allow", "deny"),
            ("socketpair",),
            (BPF_LD_W_ABS, arg + 8),
            (BPF_ALU_AND_K, SOCK_TYPE_MASK),
            (BPF_JEQ_K, SOCK_STREAM, "allow", None),
            (BPF_JEQ_K, SOCK_SEQPACKET, "allow", "deny"),
            ("allow",),
            (BPF_RET_K, SECCOMP_RET_ALLOW),
            ("deny",),
            (BPF_RET_K, deny),
            ("enosys",),
            (BPF_RET_K, enosys),
            ("kill",),
            (BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        ]
    )


def install(network: bool) -> None:
    """Install the filter on this process and its future children (no_new_privs must be set)."""
    instructions = filter_program(network)
    array = (_SockFilter * len(instructions))(*(_SockFilter(*item) for item in instructions))
    prog = _SockFprog(len(instructions), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    result = _LIBC.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
