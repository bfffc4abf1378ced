"""The python tool: no IPC out of the sandbox, and ``memory_mb`` bounds a whole call.

Hostile programs connect to Unix sockets this test owns (a 0777 socket in a 0777 directory under
/tmp, an abstract socket, a datagram socket) and fork children that together allocate more than
``memory_mb``. They run in the modes of ``tests/test_python_tool.py``; where a mode lacks the
mechanism (``bare``), the test asserts that the metrics say the gap is open.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PROMPTLY_S
from test_python_tool import MODES, assert_nothing_left, make_tool, run, sandbox_processes

from tools import sandbox_cgroup

hostile = pytest.mark.parametrize("mode", list(MODES))


class Listener:
    """A Unix socket of the host that anyone may use; records every byte it receives."""

    def __init__(self, kind: int, address: str | bytes):
        self.received: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, kind)
        self.sock.bind(address)
        if isinstance(address, str):
            os.chmod(address, 0o777)
        if kind == socket.SOCK_STREAM:
            self.sock.listen()
        self.sock.settimeout(0.05)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                if self.sock.type == socket.SOCK_STREAM:
                    conn, _ = self.sock.accept()
                    with conn:
                        conn.settimeout(1)
                        self.received.append(conn.recv(100) or b"<connected>")
                else:
                    self.received.append(self.sock.recv(100))
            except OSError:
                continue

    def close(self) -> list[bytes]:
        self.stopped.set()
        self.thread.join()
        self.sock.close()
        return self.received


@pytest.fixture
def world_writable_dir() -> Iterator[Path]:
    """A 0777 directory under /tmp, as a service started with umask 0 would leave."""
    directory = Path(tempfile.mkdtemp(prefix="rallyrl-ipc-", dir="/tmp"))
    directory.chmod(0o777)
    yield directory
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()


SEND_ALL_WAYS = """
import _socket, socket
for make in (_socket.socket, socket.socket):  # _socket's class gets past the bootstrap's socket patch
    try:
        s = make(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(ADDRESS)
        s.sendall(b"pwned")
        print("SENT")
    except Exception as exc:
        print("refused", type(exc).__name__)
"""


async def contained_or_reported(mode: str, code: str, listener: Listener) -> None:
    """Run ``code``; in a mode with no IPC protection, only check that the metrics say so."""
    try:
        response, elapsed = await run(make_tool(mode), code)
    finally:
        received = listener.close()
    if mode == "bare":  # no seccomp, namespaces or Landlock: the gap is reported, not hidden
        assert "unix-ipc-open" in response.metrics["sandbox"] and response.metrics["ipc"] == "open"
        return
    assert received == []
    assert "SENT" not in response.text and "refused" in response.text
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)


@hostile
async def test_a_world_writable_unix_socket_of_the_host_is_unreachable(mode, world_writable_dir):
    path = str(world_writable_dir / "service.sock")
    listener = Listener(socket.SOCK_STREAM, path)
    await contained_or_reported(mode, SEND_ALL_WAYS.replace("ADDRESS", repr(path)), listener)


@hostile
async def test_an_abstract_unix_socket_of_the_host_is_unreachable(mode):
    address = b"\0rallyrl-abstract-" + uuid.uuid4().hex.encode()
    listener = Listener(socket.SOCK_STREAM, address)
    await contained_or_reported(mode, SEND_ALL_WAYS.replace("ADDRESS", repr(address)), listener)


@hostile
async def test_a_datagram_socketpair_cannot_send_to_a_host_socket(mode, world_writable_dir):
    path = str(world_writable_dir / "log.sock")
    listener = Listener(socket.SOCK_DGRAM, path)
    code = f"""
import _socket
try:  # a datagram socket, connected or not, can still send to any address
    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    a.sendto(b"pwned", {path!r})
    print("SENT")
except Exception as exc:
    print("refused", type(exc).__name__)
"""
    await contained_or_reported(mode, code, listener)


async def test_without_seccomp_the_private_directories_still_hide_host_sockets(world_writable_dir):
    path = str(world_writable_dir / "service.sock")
    listener = Listener(socket.SOCK_STREAM, path)
    tool = make_tool(disable=["seccomp"])
    if not any(item.startswith("private-dirs") for item in (await run(tool, "pass"))[0].metrics["sandbox"]):
        listener.close()
        pytest.skip("no mount namespace here: nothing hides /tmp")
    response, _ = await run(tool, SEND_ALL_WAYS.replace("ADDRESS", repr(path)))
    assert listener.close() == []
    assert response.text == "refused FileNotFoundError\nrefused FileNotFoundError"
    assert "unix-ipc-partly-open" in response.metrics["sandbox"]  # sockets in /usr, /etc, ... would be reachable


async def test_socketpair_and_pipes_still_work_inside():
    code = """
import multiprocessing, socket
a, b = socket.socketpair()
a.sendall(b"ping")
print(b.recv(4).decode())
parent, child = multiprocessing.Pipe()
p = multiprocessing.Process(target=child.send, args=("pong",))
p.start()
print(parent.recv())
p.join()
"""
    response, _ = await run(make_tool(), code)
    assert response.text == "ping\npong"


# ---------------------------------------------------------------- memory per call

MEMORY_MB = 200
FOUR_CHILDREN = f"""
import os, time
kids = []
for _ in range(4):  # each stays under memory_mb (and RLIMIT_AS); together they need 2.4 x memory_mb
    pid = os.fork()
    if pid == 0:
        data = b"x" * int(0.6 * {MEMORY_MB} * 2**20)  # pages written, not just reserved
        time.sleep(0.5)
        os._exit(0)
    kids.append(pid)
print("children", [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids])
"""


def call_cgroups(run_id: str) -> list[str]:
    """The directories a call's cgroup had, in every hierarchy calls use here (existing or not)."""
    found = sandbox_cgroup.parents()
    parents = set(found[1].values()) if found else set()
    return [os.path.join(parent, sandbox_cgroup.NAME_PREFIX + run_id) for parent in parents]


@hostile
async def test_processes_together_cannot_exceed_memory_mb(mode):
    response, elapsed = await run(make_tool(mode, memory_mb=MEMORY_MB), FOUR_CHILDREN)
    sandbox, metrics = response.metrics["sandbox"], response.metrics
    if mode == "bare" or sandbox_cgroup.parents() is None:  # rlimits only: the gap is reported
        assert any(item.startswith("memory-per-process") for item in sandbox)
        assert metrics["memory_peak_mb"] is None and metrics["oom_killed"] is None
        return
    assert "children [0, 0, 0, 0]" not in response.text
    assert f"Error: killed: memory limit of {MEMORY_MB} MB exceeded" in response.text
    assert metrics["error"] is True and metrics["oom_killed"] >= 1
    assert f"cgroup-v{sandbox_cgroup.parents()[0]}-memory" in sandbox
    assert 0.6 * MEMORY_MB < metrics["memory_peak_mb"] <= MEMORY_MB + 1
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)
    assert [path for path in call_cgroups(metrics["run_id"]) if os.path.exists(path)] == []
    after, _ = await run(make_tool(mode), "print('still fine')")
    assert after.text == "still fine"


async def test_the_memory_peak_is_reported():
    response, _ = await run(make_tool(), "data = b'x' * (100 << 20)\nprint(len(data) >> 20)")
    if response.metrics["memory_peak_mb"] is None:
        pytest.skip(f"no memory cgroup here (sandbox: {response.metrics['sandbox']})")
    assert response.text == "100"
    assert 100 <= response.metrics["memory_peak_mb"] < 200 and response.metrics["oom_killed"] == 0


async def test_a_cancelled_call_leaves_no_cgroup(monkeypatch):
    tool = make_tool()
    seen: list[str] = []
    original = sandbox_cgroup.create

    def create(run_id, *args):
        seen.append(run_id)
        return original(run_id, *args)

    monkeypatch.setattr(sandbox_cgroup, "create", create)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await tool.execute("i", {"code": "import time\nwhile True:\n    time.sleep(1)"})
    assert seen and [path for path in call_cgroups(seen[0]) if os.path.exists(path)] == []
    assert sandbox_processes() == []


def test_no_call_cgroup_is_left():
    found = sandbox_cgroup.parents()
    for parent in set(found[1].values()) if found else ():
        ours = f"{sandbox_cgroup.NAME_PREFIX}{os.getpid()}-"  # not another pytest worker's
        assert [name for name in os.listdir(parent) if name.startswith(ours)] == []
