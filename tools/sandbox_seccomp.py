"""The ``python`` tool's seccomp filter: no Unix-domain IPC out of the sandbox, through ctypes.

A program could otherwise ``connect()`` to any Unix socket file it can reach (the D-Bus system
bus, an X11 or Docker socket, a service started with umask 0) or send to one with ``sendto``.
Seccomp cannot read the address ``connect`` is given, so the filter refuses the socket itself:

- ``socket(AF_UNIX, ...)``: EPERM (no listener, no client; ``socketpair`` stays: a connected pair
  of stream or seqpacket sockets reaches nothing outside the process tree);
- ``socketpair`` of any other type: EPERM (a datagram socket can ``connect``/``sendto`` anew);
- ``io_uring_setup``/``enter``/``register``: EPERM (io_uring creates sockets without ``socket``);
- a system call of another ABI (32-bit x86, x32): the process is killed.

Only x86_64 and aarch64 are known (by system call number); elsewhere ``unsupported`` says why
and no filter is installed. Standard library only (the supervisor runs with ``python -I -S``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 21, 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
BPF_LD_W_ABS, BPF_ALU_AND_K, BPF_JEQ_K, BPF_JGE_K, BPF_JGT_K, BPF_RET_K = 0x20, 0x54, 0x15, 0x35, 0x25, 0x06
AF_UNIX, SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 1, 5, 0xF
IO_URING_FIRST, IO_URING_LAST = 425, 427  # io_uring_setup, io_uring_enter, io_uring_register: every arch
X32_SYSCALL_BIT = 0x40000000
ARCHES = {  # machine: (AUDIT_ARCH_*, __NR_socket, __NR_socketpair)
    "x86_64": (0xC000003E, 41, 53),
    "aarch64": (0xC00000B7, 198, 199),
}

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
    """(label,) marks a position; (code, k, true_label, false_label) jumps; (code, k) does not."""
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


def filter_program() -> list[tuple[int, int, int, int]]:
    """The BPF program for this machine (see the module docstring)."""
    arch, nr_socket, nr_socketpair = ARCHES[os.uname().machine]
    deny = SECCOMP_RET_ERRNO | errno.EPERM
    arg = 16  # offsetof(struct seccomp_data, args): nr (4), arch (4), instruction_pointer (8); low half first
    program = [
        (BPF_LD_W_ABS, 4),
        (BPF_JEQ_K, arch, "native", "kill"),
        ("native",),
        (BPF_LD_W_ABS, 0),
        (BPF_JGE_K, X32_SYSCALL_BIT, "kill", "number"),  # x32 numbers never appear on aarch64
        ("number",),
        (BPF_JEQ_K, nr_socket, "socket", "not-socket"),
        ("not-socket",),
        (BPF_JEQ_K, nr_socketpair, "socketpair", "not-socketpair"),
        ("not-socketpair",),
        (BPF_JGE_K, IO_URING_FIRST, "io-uring?", "allow"),
        ("io-uring?",),
        (BPF_JGT_K, IO_URING_LAST, "allow", "deny"),
        ("socket",),
        (BPF_LD_W_ABS, arg),  # domain
        (BPF_JEQ_K, AF_UNIX, "deny", "allow"),
        ("socketpair",),
        (BPF_LD_W_ABS, arg + 8),  # type, with SOCK_NONBLOCK / SOCK_CLOEXEC
        (BPF_ALU_AND_K, SOCK_TYPE_MASK),
        (BPF_JEQ_K, SOCK_STREAM, "allow", "not-stream"),
        ("not-stream",),
        (BPF_JEQ_K, SOCK_SEQPACKET, "allow", "deny"),
        ("allow",),
        (BPF_RET_K, SECCOMP_RET_ALLOW),
        ("deny",),
        (BPF_RET_K, deny),
        ("kill",),
        (BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
    ]
    return _assemble(program)


def install() -> None:
    """Install the filter on this process and its future children (no_new_privs must be set)."""
    instructions = filter_program()
    array = (_SockFilter * len(instructions))(*(_SockFilter(*item) for item in instructions))
    prog = _SockFprog(len(instructions), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    result = _LIBC.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
