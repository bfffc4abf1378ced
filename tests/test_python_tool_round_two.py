"""The python tool's sandbox, second round of hostile programs: kernel keys, namespaces made from
inside, socket families, oom_score_adj, the cost of output to the trainer, the supervisor's command
line. Each class runs in every mode of ``test_python_tool.MODES`` where it applies; where a mode
cannot close it (bare: no seccomp), the test checks that ``metrics["sandbox"]`` says so."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_python_tool import MODES, assert_nothing_left, make_tool, read, run, sandbox_processes

from tools import sandbox_kernel as kernel
from tools.sandbox_run import PACKAGE_ROOT

REPO = Path(__file__).resolve().parents[1]
hostile = pytest.mark.parametrize("mode", list(MODES))
filtered = pytest.mark.parametrize("mode", [mode for mode in MODES if mode != "bare"])
KEYCTL = """
import ctypes, os
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
SESSION, USER, USER_SESSION = -3, -4, -5
JOIN, UPDATE, SETPERM, DESCRIBE, SEARCH, READ = 1, 2, 5, 6, 10, 11


def keyctl(*args):
    result = _libc.syscall(ctypes.c_long(KEYCTL), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    return result if result >= 0 else -ctypes.get_errno()


def add_key(kind, description, payload, keyring):
    result = _libc.syscall(ctypes.c_long(ADD_KEY), kind, description, payload, ctypes.c_long(len(payload)),
                           ctypes.c_long(keyring))
    return result if result >= 0 else -ctypes.get_errno()


def read_key(key):
    buffer = ctypes.create_string_buffer(4096)
    size = keyctl(READ, key, buffer, 4096)
    return buffer.raw[:size] if size >= 0 else size
"""


def keys_module() -> dict:
    namespace: dict = {}
    exec(KEYCTL, namespace)
    return namespace


def reported_gap(response, gap: str) -> None:
    """Bare mode: the gap is in the metrics (and nothing of the call is left)."""
    assert gap in response.metrics["sandbox"] and "no-seccomp (disabled)" in response.metrics["sandbox"]
    assert_nothing_left(response)


# ---------------------------------------------------------------- kernel keys

RUNNER = """
import asyncio, json, sys, uuid
sys.path.insert(0, REPO)
from tools.python_sandbox import PythonTool
KEYCTL_SOURCE
# the trainer's own session keyring, as under systemd or PAM
assert keyctl(JOIN, b"rallyrl-test-" + uuid.uuid4().hex.encode()) > 0
secret = b"s3cret-" + uuid.uuid4().hex.encode()
key = add_key(b"user", b"rallyrl-secret", secret, SESSION)
assert key > 0, key
keyring_before = read_key(SESSION)
tool = PythonTool({"timeout_s": 5, "disable": DISABLE})
response = asyncio.run(tool.execute("i", {"code": PROGRAM}))
print(json.dumps({"text": response.text, "secret": secret.decode(), "payload_same": read_key(key) == secret,
                  "keyring_same": read_key(SESSION) == keyring_before, "sandbox": response.metrics["sandbox"]}))
"""
STEAL_KEYS = """
found = keyctl(SEARCH, SESSION, b"user", b"rallyrl-secret", 0)
print("search", found)
for line in open("/proc/keys"):  # every key this process may view, by serial
    key = int(line.split()[0], 16)
    print("read", key, read_key(key))
    print("update", key, keyctl(UPDATE, key, b"overwritten", 11))
print("add", add_key(b"user", b"planted", b"x", SESSION))
"""


@hostile
def test_a_session_keyring_planted_in_the_runner_stays_unreadable_and_unchanged(mode):
    program = KEYCTL + STEAL_KEYS
    runner = RUNNER.replace("KEYCTL_SOURCE", KEYCTL).replace("REPO", repr(str(REPO)))
    runner = runner.replace("DISABLE", repr(MODES[mode])).replace("PROGRAM", repr(program))
    done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome["secret"] not in outcome["text"]
    assert outcome["payload_same"] and outcome["keyring_same"], outcome["text"]
    assert "session-keyring" in outcome["sandbox"]


@hostile
async def test_no_key_outlives_a_call(mode):
    code = (
        KEYCTL
        + """
import json
added = {}
for keyring in (SESSION, USER, USER_SESSION):
    added[keyring] = add_key(b"user", b"leftover", b"for a later call", keyring)
    if added[keyring] > 0:
        keyctl(SETPERM, added[keyring], 0x3F3F3F3F)  # readable by anyone
print(json.dumps(list(added.values())))
"""
    )
    response, _ = await run(make_tool(mode), code)
    if mode == "bare":
        return reported_gap(response, "keys-open")
    added = json.loads(response.text.splitlines()[-1])
    made = [key for key in added if key > 0]
    keys = keys_module()
    deadline = time.monotonic() + 3
    while (alive := [key for key in made if keys["keyctl"](keys["DESCRIBE"], key, None, 0) != -errno.ENOKEY]) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.05)  # the kernel collects an unlinked key's garbage asynchronously
    assert alive == [], response.text
    assert added == [-errno.EPERM] * 3, response.text  # refused outright
    assert_nothing_left(response)


# ---------------------------------------------------------------- namespaces made from inside

MAKE_NAMESPACES = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
CLONE, CLONE3 = {"x86_64": (56, 435), "aarch64": (220, 435)}[os.uname().machine]
pid = libc.syscall(ctypes.c_long(CLONE), ctypes.c_long(CLONE_NEWUSER | signal.SIGCHLD), None, None, None, None)
if pid == 0:
    os._exit(0)
print("clone", "made" if pid > 0 else os.strerror(ctypes.get_errno()))
if pid > 0:
    os.waitpid(pid, 0)
args = (ctypes.c_uint64 * 11)(CLONE_NEWUSER, 0, 0, 0, signal.SIGCHLD)  # struct clone_args
pid = libc.syscall(ctypes.c_long(CLONE3), args, ctypes.c_long(88))
if pid == 0:
    os._exit(0)
print("clone3", "made" if pid > 0 else os.strerror(ctypes.get_errno()))
print("unshare", "made" if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0 else os.strerror(ctypes.get_errno()))
"""


@hostile
async def test_a_program_cannot_create_a_user_namespace(mode):
    response, _ = await run(make_tool(mode), MAKE_NAMESPACES)
    if mode == "bare":
        return reported_gap(response, "userns-open")
    assert (
        response.text
        == "clone Operation not permitted\nclone3 Function not implemented\nunshare Operation not permitted"
    )
    assert_nothing_left(response)


HOLD_SOCKET_BUFFERS = """
import ctypes, fcntl, json, os, socket, struct
TARGET, MPTCP = 256 << 20, 262
libc = ctypes.CDLL(None, use_errno=True)


def raw(family, kind, protocol=0):  # past the bootstrap's socket patch, as a hostile program would go
    fd = libc.socket(family, kind, protocol)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return socket.socket(fileno=fd)


def fill(sock):
    sock.setblocking(False)
    sent = 0
    try:
        while True:
            sent += sock.send(bytes(1 << 16))
    except (BlockingIOError, OSError):
        return sent


held = 0
os.write(1, json.dumps({"tcp": held}).encode() + b"\\n")
try:
    if libc.unshare(0x10000000 | 0x40000000) == 0:  # its own user and network namespace: bring loopback up
        fcntl.ioctl(raw(socket.AF_INET, socket.SOCK_DGRAM), 0x8914, struct.pack("16sh", b"lo", 1 | 8))
    server = raw(socket.AF_INET, socket.SOCK_STREAM, MPTCP)  # (else the loopback it has, if any)
    server.bind(("127.0.0.1", 0))
    server.listen(512)
    kept = []
    while held < TARGET:  # MPTCP (past Landlock's TCP rules) buffers, which cgroup v1 does not charge
        client = raw(socket.AF_INET, socket.SOCK_STREAM, MPTCP)
        client.connect(server.getsockname())
        kept += [client, server.accept()[0]]
        held += fill(client)
        os.write(1, json.dumps({"tcp": held}).encode() + b"\\n")
except OSError as exc:
    print("refused:", exc)
"""


@filtered
async def test_socket_buffers_cannot_grow_past_memory_mb(mode):
    memory_mb = 96
    response, _ = await run(
        make_tool(mode, memory_mb=memory_mb, timeout_s=20, max_output_chars=100_000), HOLD_SOCKET_BUFFERS
    )
    last: dict[str, int] = {}
    for line in response.text.splitlines():
        if line.startswith("{"):
            last.update(json.loads(line))
    assert last, response.text
    assert sum(last.values()) <= memory_mb << 20, (last, response.text[-300:])
    assert_nothing_left(response)


# ---------------------------------------------------------------- socket families

TRY_SOCKETS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK = 2, 10, 16, 17, 40
STREAM, DGRAM, RAW, SEQPACKET = 1, 2, 3, 5
tries = {
    "vsock": (AF_VSOCK, STREAM, 0), "mptcp": (AF_INET, STREAM, 262), "mptcp6": (AF_INET6, STREAM, 262),
    "sctp": (AF_INET, STREAM, 132), "sctp-seqpacket": (AF_INET, SEQPACKET, 132), "packet": (AF_PACKET, RAW, 0),
    "device-events": (AF_NETLINK, DGRAM, 15), "tcp": (AF_INET, STREAM, 0), "udp6": (AF_INET6, DGRAM, 17),
}
for name, args in tries.items():
    fd = libc.socket(*args)
    print(name, "made" if fd >= 0 else os.strerror(ctypes.get_errno()))
"""


@hostile
async def test_vsock_mptcp_sctp_and_other_socket_families_are_refused(mode):
    response, _ = await run(make_tool(mode), TRY_SOCKETS)
    if mode == "bare":
        return reported_gap(response, "socket-families-open")
    outcome = dict(line.split(" ", 1) for line in response.text.splitlines())
    for name in ("vsock", "mptcp", "mptcp6", "sctp", "sctp-seqpacket", "packet", "device-events"):
        assert outcome[name] == "Operation not permitted", (name, response.text)
    has_netns = response.metrics["network"] == "netns"  # TCP and UDP exist only in a network of its own
    expected = "made" if has_netns else "Operation not permitted"
    assert outcome["tcp"] == outcome["udp6"] == expected, response.text
    assert_nothing_left(response)


# ---------------------------------------------------------------- oom_score_adj

SLEEPERS = """
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # MARK"]) for _ in range(3)]
print("started", flush=True)
time.sleep(30)
"""


@hostile
async def test_every_process_of_the_program_has_oom_score_adj_1000_from_outside(mode):
    marker = f"rallyrl-oom-{uuid.uuid4().hex}"
    call = asyncio.create_task(run(make_tool(mode, timeout_s=30), SLEEPERS.replace("MARK", marker)))
    try:
        programs: list[int] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ours = [pid for pid in sandbox_processes() if b"sandbox_supervisor" not in read(f"/proc/{pid}/cmdline")]
            if sum(marker.encode() in read(f"/proc/{pid}/cmdline") for pid in ours) == 3:
                programs = ours
                break
            await asyncio.sleep(0.05)
        assert len(programs) == 4  # the program and its three children
        scores = {pid: read(f"/proc/{pid}/oom_score_adj").strip() for pid in programs}
        assert set(scores.values()) == {b"1000"}, scores
    finally:
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    assert sandbox_processes() == []


async def test_oom_score_adj_is_reported_as_applied_and_a_failure_with_its_reason():
    response, _ = await run(make_tool(), "pass")
    assert [item for item in response.metrics["sandbox"] if "oom-score-adj" in item] == ["oom-score-adj"]
    before = Path("/proc/self/oom_score_adj").read_text()
    assert kernel.set_oom_score_adj(2000) == "no-oom-score-adj ([Errno 22] Invalid argument)"  # out of range
    assert Path("/proc/self/oom_score_adj").read_text() == before


# ---------------------------------------------------------------- output, command line, terminal bytes

ONE_BYTE_AT_A_TIME = """
import os, time
end = time.monotonic() + 3
while time.monotonic() < end:
    os.write(1, b"x")
    time.sleep(0.0001)
"""


async def test_a_one_byte_at_a_time_writer_costs_the_event_loop_little():
    tool = make_tool(timeout_s=10, max_output_chars=100_000)
    await run(tool, "pass")  # the interpreter's paths, read once per process, are not this call's cost
    before = resource.getrusage(resource.RUSAGE_SELF)
    response, _ = await run(tool, ONE_BYTE_AT_A_TIME)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert response.metrics["output_bytes"] > 3000 and response.metrics["error"] is False
    assert cpu_s < 0.3, (cpu_s, response.metrics["output_bytes"])


async def test_the_supervisor_command_line_holds_no_host_path():
    response, _ = await run(make_tool(), "print(open('/proc/1/cmdline', 'rb').read().decode())")
    if "pidns" not in response.metrics["sandbox"]:
        pytest.skip("no PID namespace: /proc/1 is not the sandbox's")
    cmdline = response.text
    assert cmdline.startswith("python") and "sandbox_supervisor" in cmdline
    for host_path in (PACKAGE_ROOT, "rallyrl-python-", os.path.dirname(sys.executable), '"workdir"'):
        assert host_path not in cmdline, host_path


async def test_nul_and_escape_bytes_reach_the_trajectory_as_written():
    response, _ = await run(make_tool(), "import sys\nsys.stdout.write('a\\x00b\\x1b[2Jc\\x07')")
    assert response.text == "a\x00b\x1b[2Jc\x07"
