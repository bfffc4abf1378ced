"""The python tool: each call runs in a sandboxed process tree that is gone when the call returns.

Hostile programs run under three configurations: the strongest mechanisms this machine allows,
no namespaces (like root in a default Docker container) and bare (subreaper, rlimits, watchdog
and the socket patch only). A test whose protection needs a mechanism the configuration lacks
skips before running the program, saying which.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import PROMPTLY_S, ScriptedEngine, call

from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.tokens import ChatTokenizer
from tools.python_sandbox import PythonTool
from tools.sandbox_supervisor import OPTIONAL_MECHANISMS, RUN_ENV

REPO = Path(__file__).resolve().parents[1]
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
MODES = {
    "strongest": [],
    "no-namespaces": ["userns", "pidns", "netns", "mntns"],
    "bare": list(OPTIONAL_MECHANISMS),
}
_SANDBOXES: dict[str, list[str]] = {}


def make_tool(mode: str = "strongest", **config) -> PythonTool:
    return PythonTool({"timeout_s": 5, "disable": MODES[mode], **config})


async def run(tool: PythonTool, code: str):
    """Execute ``code``; the response and the wall time of the call."""
    started = time.monotonic()
    response = await tool.execute("i", {"code": code})
    return response, time.monotonic() - started


async def sandbox_of(mode: str) -> list[str]:
    """The mechanisms a call gets in ``mode`` on this machine (probed once with an empty program)."""
    if mode not in _SANDBOXES:
        response, _ = await run(make_tool(mode), "pass")
        _SANDBOXES[mode] = response.metrics["sandbox"]
    return _SANDBOXES[mode]


async def require(mode: str, *any_of: str) -> None:
    """Skip unless the sandbox of ``mode`` has one of the mechanisms named by prefix."""
    sandbox = await sandbox_of(mode)
    if not any(item.startswith(prefix) for item in sandbox for prefix in any_of):
        pytest.skip(f"{mode}: none of {any_of} on this machine (sandbox: {sandbox})")


def read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def sandbox_processes(run_id: str | None = None, marker: str | None = None) -> list[int]:
    """Live processes whose environment carries the call's run id (when None, that of any run this
    process started: not those of another pytest worker) or whose command line contains ``marker``."""
    env = f"{RUN_ENV}={run_id or f'{os.getpid()}-'}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        in_env = any(item.startswith(env) for item in read(f"/proc/{pid}/environ").split(b"\0"))
        if in_env or (marker and marker.encode() in read(f"/proc/{pid}/cmdline")):
            found.append(int(pid))
    return found


def assert_nothing_left(response, marker: str | None = None) -> None:
    assert sandbox_processes(response.metrics["run_id"], marker) == []


# ---------------------------------------------------------------- ordinary programs


async def test_prints_output():
    response, _ = await run(make_tool(), "print('hello')\nprint(6 * 7)")
    assert response.text == "hello\n42"
    assert response.metrics["exit_code"] == 0 and response.metrics["error"] is False


async def test_a_program_without_output_says_so():
    response, _ = await run(make_tool(), "x = 1")
    assert response.text == "(no output)"


async def test_exception_comes_back_as_a_traceback_from_main_py():
    response, _ = await run(make_tool(), "print('before')\n\ndef f():\n    raise ValueError('bad value')\n\nf()")
    assert response.text.startswith("before\n[stderr]\nTraceback (most recent call last):\n")
    assert 'File "main.py", line 6, in <module>' in response.text
    assert "raise ValueError('bad value')" in response.text  # source lines are shown
    assert "<string>" not in response.text  # no frame of the bootstrap
    assert response.text.endswith("ValueError: bad value\nError: exit code 1")


async def test_syntax_error_is_reported():
    response, _ = await run(make_tool(), "print('unclosed'")
    assert "SyntaxError" in response.text and response.text.endswith("Error: exit code 1")


async def test_exit_code_is_reported():
    response, _ = await run(make_tool(), "import sys\nprint('partial')\nsys.exit(3)")
    assert response.text == "partial\nError: exit code 3"
    assert response.metrics["exit_code"] == 3 and response.metrics["error"] is True


async def test_standard_library_and_site_packages_import():
    response, _ = await run(make_tool(), "import json, math, fractions, numpy\nprint(json.dumps(math.comb(5, 2)))")
    assert response.text == "10"


async def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("RALLYRL_TEST_TOKEN", "do-not-inherit")
    code = "import os\nprint(' '.join(sorted(os.environ)))\nprint(os.environ['HOME'] == os.getcwd())"
    response, _ = await run(make_tool(), code)
    names, home_is_cwd = response.text.splitlines()
    assert set(names.split()) == {
        *("PATH", "LANG", "LC_ALL", "USER", "LOGNAME", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE"),
        "PYTHONUNBUFFERED",
        *("PYTHONIOENCODING", "MPLBACKEND", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", RUN_ENV),
    }
    assert home_is_cwd == "True"


async def test_each_call_gets_a_fresh_working_directory_removed_afterwards():
    tool = make_tool()
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('left.txt', 'w').write('x')"
    first, _ = await run(tool, code)
    second, _ = await run(tool, code)
    first_dir, second_dir = first.text.splitlines()[0], second.text.splitlines()[0]
    assert first_dir != second_dir
    assert first.text.splitlines()[1] == second.text.splitlines()[1] == "['main.py']"
    assert not Path(first_dir).exists() and not Path(second_dir).exists()


async def test_working_directory_has_a_size_limit():
    await require("strongest", "tmpfs-workdir")
    code = "for i in range(3):\n    open(f'f{i}', 'wb').write(bytes(15 << 20))\n    print('wrote', i)"
    response, _ = await run(make_tool(disk_mb=32, file_size_mb=16), code)
    assert response.text.startswith("wrote 0\nwrote 1\n[stderr]\nTraceback")
    assert "OSError: [Errno 28] No space left on device" in response.text


async def test_file_size_limit():
    response, _ = await run(make_tool(file_size_mb=1), "open('big', 'wb').write(bytes(2 << 20))")
    assert "OSError: [Errno 27] File too large" in response.text


async def test_long_output_keeps_head_and_tail():
    response, _ = await run(make_tool(max_output_chars=500), "for i in range(20000):\n    print(i)")
    assert response.text.startswith("0\n1\n2\n") and response.text.endswith("19998\n19999")
    assert "cut]" in response.text and len(response.text) < 700
    assert response.metrics["error"] is False  # 109 kB is under the kill threshold


async def test_at_most_max_concurrent_programs_run_at_once():
    tool = make_tool(max_concurrent=2)
    code = "import time\nstart = time.time()\ntime.sleep(0.4)\nprint(start, time.time())"
    responses = await asyncio.gather(*(tool.execute("i", {"code": code}) for _ in range(5)))
    intervals = [tuple(map(float, r.text.split())) for r in responses]
    most = max(sum(start <= t < end for start, end in intervals) for t, _ in intervals)
    assert most == 2


async def test_missing_code_is_an_error_for_the_model():
    response = await make_tool().execute("i", {"source": "print(1)"})
    assert response.text.startswith("Error: python needs 'code'")


@pytest.mark.parametrize(
    ("config", "message"),
    [({"timeout_s": 0}, "'timeout_s' must be a positive number"), ({"memory_mb": 1.5}, "'memory_mb' must be")]
    + [({"disable": ["firewall"]}, "'disable': unknown"), ({"timeout": 3}, "unknown key(s) ['timeout']")],
)
def test_bad_config_is_refused_with_the_key(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        PythonTool(config)


async def test_the_sandbox_in_use_is_reported():
    response, _ = await run(make_tool(), "pass")
    sandbox = response.metrics["sandbox"]
    assert {"subreaper", "rlimits"} <= set(sandbox)
    assert ("nproc" in sandbox) != ("watchdog" in sandbox)
    assert response.metrics["network"] in {"netns", "landlock-tcp+socket-patch", "socket-patch"}
    bare, _ = await run(make_tool("bare"), "pass")
    assert bare.metrics["sandbox"] == [
        *("subreaper", "rlimits", "memory-per-process (disabled)", "oom-score-adj", "session-keyring", "watchdog"),
        *("no-seccomp (disabled)", "unix-ipc-open", "keys-open", "userns-open", "socket-families-open"),
        "comm-open",
    ]
    assert bare.metrics["network"] == "socket-patch" and bare.metrics["ipc"] == "open"


async def test_cancelled_call_leaves_no_process_and_no_directory():
    tool = make_tool()
    before = set(Path(tempfile.gettempdir()).glob(f"rallyrl-python-{os.getpid()}-*"))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await tool.execute("i", {"code": "import time\nwhile True:\n    time.sleep(1)"})
    assert sandbox_processes() == []
    assert set(Path(tempfile.gettempdir()).glob(f"rallyrl-python-{os.getpid()}-*")) <= before


# ---------------------------------------------------------------- hostile programs

hostile = pytest.mark.parametrize("mode", list(MODES))


@hostile
async def test_infinite_loop_times_out(mode):
    response, elapsed = await run(make_tool(mode, timeout_s=1), "print('started')\nwhile True:\n    pass")
    assert response.text == "started\nError: timed out after 1 s; the program and all its processes were killed"
    assert response.metrics["timed_out"] is True
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)


async def test_cpu_time_limit_kills():
    response, elapsed = await run(make_tool(cpu_s=1, timeout_s=10), "while True:\n    pass")
    assert response.text == "Error: killed: CPU time limit of 1 s"
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)


@hostile
async def test_fork_bomb_is_contained(mode):
    peak = 0
    done = asyncio.Event()

    async def count():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(await asyncio.to_thread(sandbox_processes)))
            await asyncio.sleep(0.02)

    counter = asyncio.create_task(count())
    try:
        response, elapsed = await run(make_tool(mode, timeout_s=2, max_processes=20), FORK_BOMB)
    finally:
        done.set()
        await counter
    assert response.text.startswith("Error: ")  # timed out, or killed past max_processes
    assert elapsed < PROMPTLY_S
    # RLIMIT_NPROC holds the count (+ supervisor and init); the watchdog kills within ~10 ms of crossing it
    assert peak <= 20 + 2 if "nproc" in response.metrics["sandbox"] else peak < 100
    assert_nothing_left(response)
    usable = subprocess.run([sys.executable, "-c", "print('usable')"], capture_output=True, text=True)
    assert usable.stdout == "usable\n"


async def test_a_fork_bomb_does_not_starve_a_concurrent_call():
    tool = make_tool(timeout_s=2, max_processes=20)
    calm = "import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(5)']).returncode)"

    async def during_the_bomb():
        await asyncio.sleep(0.5)
        return await tool.execute("i", {"code": calm})

    bombed, answered = await asyncio.gather(tool.execute("i", {"code": FORK_BOMB}), during_the_bomb())
    assert bombed.text.startswith("Error: ")
    assert answered.text == "5\n0"  # its own processes are counted apart from the bomb's


@hostile
async def test_ten_gigabyte_allocation_fails_inside(mode):
    response, elapsed = await run(make_tool(mode), "data = bytearray(10 * 1024**3)\nprint('allocated')")
    assert "allocated" not in response.text
    assert "MemoryError" in response.text
    assert response.text.endswith("Error: exit code 1: out of memory (MemoryError; the memory limit is 1024 MB)")
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)


@hostile
async def test_writing_outside_the_working_directory_is_refused(mode):
    await require(mode, "read-only-fs", "landlock")
    marker = uuid.uuid4().hex
    escape, in_repo = Path(f"/tmp/escape-{marker}"), REPO / f"escape-{marker}"
    canary = Path(f"/tmp/rallyrl-canary-{marker}")
    canary.write_text("untouched")
    canary.chmod(0o666)  # writable by anyone: only the sandbox can stop the program
    code = f"""
import os
for path in [{str(escape)!r}, {str(in_repo)!r}, {str(canary)!r}]:
    try:
        with open(path, "a") as f:
            f.write("pwned")
        print("WROTE", path)
    except OSError as exc:
        print("refused", type(exc).__name__)
try:
    os.mkdir({str(escape) + "-dir"!r})
    print("WROTE dir")
except OSError as exc:
    print("refused", type(exc).__name__)
open("inside.txt", "w").write("fine")
print("inside", open("inside.txt").read())
"""
    try:
        response, _ = await run(make_tool(mode), code)
    finally:
        for path in (escape, in_repo, Path(f"{escape}-dir")):
            if path.is_dir():
                path.rmdir()
            elif path.exists():
                path.unlink()
        canary_text = canary.read_text()
        canary.unlink()
    assert "WROTE" not in response.text
    assert response.text.count("refused") == 4
    assert response.text.endswith("inside fine")
    assert canary_text == "untouched"
    assert_nothing_left(response)


@hostile
async def test_parent_environment_is_invisible(mode, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RALLYRL_TEST_SECRET", secret)
    code = f"""
import os
found = [name for name, value in os.environ.items() if {secret!r} in value]
print("environ", found)
try:
    listed = os.listdir("/proc")
except OSError:
    listed = []
for pid in [os.getppid(), *listed, HELPER]:
    try:
        data = open(f"/proc/{{pid}}/environ", "rb").read()
    except OSError:
        continue
    if {secret!r}.encode() in data:
        found.append(pid)
print("found", found)
"""
    needs_proc = ("private-proc", "setuid", "landlock")
    if not any(i.startswith(p) for i in await sandbox_of(mode) for p in needs_proc):
        response, _ = await run(make_tool(mode), code.replace("HELPER", "1").split("try:")[0])
        assert response.text == "environ []"  # the scrubbed environment still holds
        pytest.skip(f"{mode}: /proc of other processes is readable without {needs_proc}")
    # a process that has the secret in its initial environment, which /proc/<pid>/environ shows
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ))
    try:
        response, _ = await run(make_tool(mode), code.replace("HELPER", str(helper.pid)))
    finally:
        helper.kill()
        helper.wait()
    assert secret not in response.text
    assert response.text == "environ []\nfound []"
    assert_nothing_left(response)


@hostile
async def test_the_program_holds_no_capability(mode):
    sandbox = await sandbox_of(mode)
    if os.geteuid() == 0 and not any(item.startswith(("setuid", "root-without-capabilities")) for item in sandbox):
        pytest.skip(f"{mode}: the program keeps root's capabilities (sandbox: {sandbox})")
    code = """
import os
print(*[line.split()[1] for line in open("/proc/self/status") if line.startswith(("CapEff", "CapPrm"))])
try:
    os.nice(-1)
    print("raised its priority")
except OSError as exc:
    print("refused", type(exc).__name__)
"""
    response, _ = await run(make_tool(mode), code)
    assert response.text == "0000000000000000 0000000000000000\nrefused PermissionError"


@hostile
async def test_socket_to_localhost_never_connects(mode):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as exc:
    print("refused", type(exc).__name__)
"""
        response, _ = await run(make_tool(mode), code)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert "CONNECTED" not in response.text and response.text.startswith("refused")
    assert_nothing_left(response)


@hostile
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_gigabytes_of_output_are_cut_off(mode, stream):
    code = f"import sys\nchunk = 'x' * (1 << 20)\nwhile True:\n    sys.{stream}.write(chunk)"
    response, elapsed = await run(make_tool(mode, max_output_chars=1000), code)
    assert response.text.endswith(f"Error: killed: the program wrote more than {1 << 20} bytes of output")
    assert len(response.text) < 1300
    assert 1 << 20 < response.metrics["output_bytes"] < 64 << 20
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)


@hostile
async def test_killing_its_parent_is_reported(mode):
    tool = make_tool(mode)
    code = "import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(0.3)\nprint('still here')"
    response, _ = await run(tool, code)
    assert "Error: " in response.text  # PermissionError (exit code 1), or the monitor was killed
    assert_nothing_left(response)
    after, _ = await run(tool, "print('next call')")  # this process and the tool carry on
    assert after.text == "next call"


@hostile
async def test_recursion_bomb_is_contained(mode):
    code = """
import sys
sys.setrecursionlimit(10**8)

class Bomb:  # recursion through a C slot: the C stack overflows, the process crashes
    def __repr__(self):
        return repr(self)

repr(Bomb())
"""
    response, elapsed = await run(make_tool(mode), code)
    assert response.text.startswith("Error: killed by signal SIGSEGV (a crash: often a stack overflow")
    assert elapsed < PROMPTLY_S
    assert_nothing_left(response)


async def test_runaway_recursion_is_a_recursion_error():
    response, _ = await run(make_tool(), "def f(n):\n    return f(n + 1)\n\nf(0)")
    assert "RecursionError: maximum recursion depth exceeded" in response.text
    assert response.text.endswith("Error: exit code 1")


@hostile
async def test_detached_child_does_not_outlive_the_call(mode):
    marker = f"rallyrl-daemon-{uuid.uuid4().hex}"
    code = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the daemon: reparented away from us, in its own session, no marker in env
        os.execve(sys.executable, [sys.executable, "-c", "import time\\nwhile True: time.sleep(0.1)", {marker!r}], {{}})
    os._exit(0)
os.wait()
time.sleep(0.3)
print("detached")
"""
    response, _ = await run(make_tool(mode), code)
    assert response.text == "detached"
    assert_nothing_left(response, marker)


# ---------------------------------------------------------------- in a rollout


@pytest.fixture
def python_chat(tokenizer):
    return ChatTokenizer(tokenizer, [PythonTool.default_schema()])


def new_request() -> AsyncRolloutRequest:
    return AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "Compute."}])


async def test_rollout_with_a_hostile_program_completes_normally(python_chat):
    tool = make_tool(timeout_s=1)
    turns = [call("python", code=FORK_BOMB), "It did not finish."]
    engine = ScriptedEngine(python_chat, lambda i, prompt, rid: turns[min(i, 1)])
    request = await run_request(new_request(), engine, python_chat, {"python": tool}, RolloutConfig())
    assert request.finish_reason is FinishReason.STOP
    tool_messages = [m["content"] for m in request.messages if m["role"] == "tool"]
    assert tool_messages == ["Error: timed out after 1 s; the program and all its processes were killed"]
    assert request.tool_calls[0].metrics["timed_out"] is True
    assert request.messages[-1] == {"role": "assistant", "content": "It did not finish."}
    assert sandbox_processes() == []


async def test_rollout_tool_timeout_cancels_the_program(python_chat):
    tool = make_tool(timeout_s=30)
    turns = [call("python", code="while True:\n    pass"), "ok"]
    engine = ScriptedEngine(python_chat, lambda i, prompt, rid: turns[min(i, 1)])
    config = RolloutConfig(tool_timeout_s=0.5)
    request = await run_request(new_request(), engine, python_chat, {"python": tool}, config)
    assert request.finish_reason is FinishReason.STOP
    assert [m["content"] for m in request.messages if m["role"] == "tool"] == [
        "Error: tool python timed out after 0.5 s"
    ]
    assert request.tool_calls[0].latency_s < 3
    assert sandbox_processes() == []


def test_no_sandbox_process_survives_the_module():
    assert sandbox_processes() == []
    assert os.getpid() > 0 and signal.SIGKILL  # this process is alive after every hostile program
