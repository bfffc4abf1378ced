"""Servers started by a benchmark or a test are stopped, their whole process groups, when it gets
SIGTERM, as on Ctrl-C (``rollout/serve/processes.py``): a real ``python -m benchmarks.engines``
with a real ``rallyrl serve``, and small programs whose "server" forks a worker that ignores SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from rollout.serve.processes import group_alive

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

SERVER = """
import os, signal, time
if os.fork() == 0:  # a worker that only SIGKILL stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(300)
"""
PROGRAM = """
import subprocess, sys, time
from pathlib import Path
from rollout.serve.processes import ServeProcess
server = ServeProcess("http://127.0.0.1:9", subprocess.Popen([sys.executable, "-c", {server!r}],
                      start_new_session=True), Path("server.log"))
print(server.process.pid, flush=True)
{body}
"""


def start_program(tmp_path: Path, body: str) -> tuple[subprocess.Popen, int]:
    """A Python program that starts the two-process "server" in a session of its own, then runs
    ``body``; returns it and the server's process group, once the server's worker is forked."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.format(server=SERVER, body=body))
    program = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=ENV, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert program.stdout is not None
    pgid = int(program.stdout.readline())
    deadline = time.monotonic() + 10
    while len(members(pgid)) < 2:
        assert time.monotonic() < deadline, "the server's worker never started"
        time.sleep(0.02)
    time.sleep(0.2)  # (the worker ignores SIGTERM by now; the program is in its body)
    return program, pgid


def members(pgid: int) -> list[int]:
    """Live processes of group ``pgid``."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            stat = Path("/proc", name, "stat").read_text()
            state, _, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == pgid and state not in ("Z", "X"):
                found.append(int(name))
    return found


def children(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, command line) of each child of ``pid``."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            stat = Path("/proc", name, "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append((int(name), Path("/proc", name, "cmdline").read_bytes().decode().split("\0")))
    return found


def gone_within(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def killed(*groups: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def test_sigterm_stops_a_server_and_the_worker_it_forked_which_ignores_sigterm(tmp_path):
    """SIGTERM is Ctrl-C while a server runs: the program's ``finally`` stops it, SIGTERM to its group
    and SIGKILL once the grace period is over (the worker ignores SIGTERM)."""
    program, pgid = start_program(tmp_path, "try:\n    time.sleep(300)\nfinally:\n    server.stop(timeout_s=1)")
    try:
        program.send_signal(signal.SIGTERM)
        assert program.wait(timeout=15) == -signal.SIGINT  # ended by KeyboardInterrupt, as Ctrl-C ends it
        assert gone_within(pgid, 2), f"left running: {members(pgid)}"
        assert "KeyboardInterrupt" in program.stderr.read()  # type: ignore[union-attr]
    finally:
        killed(program.pid, pgid)


def test_a_second_sigterm_kills_the_servers_at_once_when_the_cleanup_hangs(tmp_path):
    program, pgid = start_program(tmp_path, "try:\n    time.sleep(300)\nfinally:\n    time.sleep(300)")
    try:
        program.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert program.poll() is None and len(members(pgid)) == 2  # in its (hanging) cleanup
        program.send_signal(signal.SIGTERM)
        assert gone_within(pgid, 3), f"left running: {members(pgid)}"
        program.wait(timeout=10)
    finally:
        killed(program.pid, pgid)


def test_a_server_that_a_program_did_not_stop_is_stopped_when_it_exits(tmp_path):
    program, pgid = start_program(tmp_path, "sys.stdin.readline()\nsys.exit(0)")
    try:
        program.communicate("exit\n", timeout=15)
        assert program.returncode == 0
        assert gone_within(pgid, 1), f"left running: {members(pgid)}"
    finally:
        killed(program.pid, pgid)


def test_the_engines_benchmark_stopped_by_sigterm_mid_run_stops_its_rallyrl_serve(tmp_path):
    """The report of issue 42: ``python -m benchmarks.engines`` stopped with SIGTERM left its server
    running. Here its ``rallyrl serve`` has answered requests when the benchmark gets SIGTERM."""
    command = [sys.executable, "-m", "benchmarks.engines", "--engines", "serve", "--quick", "--repeats", "1",
               "--log-dir", str(tmp_path)]  # fmt: skip
    with (tmp_path / "bench.log").open("wb") as log:
        bench = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    server, served = None, 0
    try:
        deadline = time.monotonic() + 90
        while server is None or served == 0:
            assert bench.poll() is None, (tmp_path / "bench.log").read_text()
            assert time.monotonic() < deadline, "the benchmark's server never served a request"
            time.sleep(0.2)
            serving = [(pid, line) for pid, line in children(bench.pid) if "serve" in line]
            if serving:
                server, line = serving[0]
                url = f"http://127.0.0.1:{line[line.index('--port') + 1]}"
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(f"{url}/get_server_info", timeout=2) as answer,
                ):
                    served = orjson.loads(answer.read())["internal_states"][0]["requests"]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=20) == -signal.SIGINT, (tmp_path / "bench.log").read_text()
        assert gone_within(server, 3), f"rallyrl serve left running: {members(server)}"
    finally:
        killed(bench.pid, *([server] if server else []))
