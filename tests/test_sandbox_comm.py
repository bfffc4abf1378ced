"""The python tool's sandbox and the kernel log (issue 41, part 3): when a process segfaults or is
OOM-killed, the kernel prints its name (comm), and a program must not choose it. Each route is
tried: ``prctl(PR_SET_NAME)`` (and ``pthread_setname_np``), writing ``/proc/self/comm`` or a thread's
comm, executing a copy, a symlink or a hard link of the interpreter or of a system binary under a
chosen name (a hard link may be made, never executed), ``fexecve`` of a memfd named so; the process
then segfaults or is OOM-killed, and where ``/dev/kmsg`` is readable no new kernel message may hold
the name. Modes: ``test_python_tool.MODES`` and ``no-landlock`` (the noexec tmpfs alone); a mode that
cannot close the channel must say ``comm-open``, and its route tests skip, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_python_tool import MODES, assert_nothing_left

from tools.python_sandbox import PythonTool

COMM_MODES = {**MODES, "no-landlock": ["landlock"]}
BASE_NAME = Path(sys.executable).name[:15]
"""The name every process of the program has: the interpreter's file name (the kernel keeps 15 bytes)."""
MEMORY_MB = 200
_SANDBOXES: dict[str, list[str]] = {}
modes = pytest.mark.parametrize("mode", list(COMM_MODES))

HELPERS = """
import contextlib, ctypes, errno, json, os, signal, sys, threading
NAME = __NAME__
libc = ctypes.CDLL(None, use_errno=True)
libc.pthread_self.restype = ctypes.c_ulong

def say(outcome):  # one write per line: processes printing at once do not interleave
    os.write(1, json.dumps(outcome).encode() + b"\\n")

def own_name():  # PR_GET_NAME: the calling thread's comm, what the kernel prints
    buffer = ctypes.create_string_buffer(16)
    libc.prctl(16, buffer, 0, 0, 0)
    return buffer.value.decode()

def by_prctl():
    return "done" if libc.prctl(15, NAME.encode(), 0, 0, 0) == 0 else errno.errorcode[ctypes.get_errno()]

def by_pthread(thread):  # glibc: prctl for the calling thread, /proc/self/task/<tid>/comm for another
    code = libc.pthread_setname_np(ctypes.c_ulong(thread), NAME.encode())
    return errno.errorcode[code] if code else "done"

def by_proc(path):
    try:
        with open(path, "w") as f:
            f.write(NAME)
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]

def comm_of(pid):  # every thread's; without a PID namespace, Landlock hides other processes' entries
    names = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that had just ended
                names.append(open(f"/proc/{pid}/task/{tid}/comm").read().strip())
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return sorted(names)

def crash(rename, in_thread=False):
    '''A child that tries ``rename`` (in a thread of its own, or its main thread), reports its name,
    then segfaults in that thread.'''
    report_read, report_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        def body():
            tried = rename()
            os.write(report_write, json.dumps({"tried": tried, "name": own_name()}).encode())
            os.read(go_read, 1)
            ctypes.string_at(0)

        if in_thread:
            threading.Thread(target=body).start()
            threading.Event().wait()
        body()
    os.close(report_write)
    outcome = json.loads(os.read(report_read, 4096))
    outcome["comm"] = comm_of(pid)
    os.write(go_write, b"x")
    status = os.waitpid(pid, 0)[1]
    outcome["signal"] = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else "none"
    say(outcome)
"""


@pytest.fixture
def kernel_log():
    """/dev/kmsg opened at its end (its fd), or why it cannot be read here (a string)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        yield f"/dev/kmsg cannot be read here ({exc}; kernel.dmesg_restrict or no CAP_SYSLOG)"
        return
    os.lseek(fd, 0, os.SEEK_END)
    yield fd
    os.close(fd)


def new_messages(kernel_log: int) -> list[str]:
    """The kernel's messages since the last read (a record per read)."""
    messages = []
    while True:
        try:
            record = os.read(kernel_log, 8192)
        except BlockingIOError:
            return messages
        except BrokenPipeError:  # records overwritten meanwhile: the next read goes on after them
            continue
        messages.append(record.decode(errors="replace").split(";", 1)[-1])


def assert_not_logged(kernel_log: int | str, name: str) -> list[str]:
    """No new kernel message holds ``name`` (they are returned); skips where the log cannot be read."""
    if isinstance(kernel_log, str):
        pytest.skip(f"the program's own checks passed; not the kernel log's: {kernel_log}")
    messages = new_messages(kernel_log)
    assert [message for message in messages if name in message] == []
    return messages


def chosen_name() -> str:
    return f"evil{uuid.uuid4().hex[:8]}"  # 12 bytes: whole in a comm


def make_tool(mode: str, **config) -> PythonTool:
    return PythonTool({"timeout_s": 10, "file_size_mb": 64, "disable": COMM_MODES[mode], **config})


async def run_named(mode: str, name: str, body: str, **config):
    """Run HELPERS + ``body`` with NAME = ``name``: the response and the JSON lines it printed."""
    response = await make_tool(mode, **config).execute("i", {"code": HELPERS.replace("__NAME__", repr(name)) + body})
    outcomes = [json.loads(line) for line in response.text.splitlines() if line.startswith(("{", "["))]
    return response, outcomes


async def sandbox_of(mode: str) -> list[str]:
    if mode not in _SANDBOXES:
        response = await make_tool(mode).execute("i", {"code": "pass"})
        _SANDBOXES[mode] = response.metrics["sandbox"]
    return _SANDBOXES[mode]


async def require_closed(mode: str) -> None:
    sandbox = await sandbox_of(mode)
    if "comm-open" in sandbox:
        pytest.skip(f"{mode}: comm-open, no seccomp or neither noexec-tmpfs nor Landlock here (sandbox: {sandbox})")


# ---------------------------------------------------------------- what the sandbox reports


def test_outside_the_sandbox_the_kernel_logs_a_chosen_name(kernel_log):
    if isinstance(kernel_log, str):
        pytest.skip(kernel_log)
    name = chosen_name()
    crash = f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\nctypes.string_at(0)"
    reports = []
    for _ in range(2):  # the kernel reports at most 10 segfaults in 5 s
        subprocess.run([sys.executable, "-c", crash], capture_output=True, timeout=30)
        reports += [message for message in new_messages(kernel_log) if "segfault" in message]
        if any(name in message for message in reports):
            return
        time.sleep(5.5)
    if not reports:  # (debug.exception-trace 0, or the reports rate-limited away by other processes)
        pytest.skip("this kernel logged no segfault report at all")
    pytest.fail(f"no segfault report naming {name} in the kernel log: {reports[-3:]}")


@modes
async def test_comm_open_is_reported_exactly_where_seccomp_or_both_noexec_and_landlock_are_missing(mode):
    sandbox = await sandbox_of(mode)
    seccomp = "seccomp:no-comm" in sandbox
    assert seccomp != any(item.startswith("no-seccomp") for item in sandbox)
    if "mntns" in sandbox and os.geteuid() == 0:  # as root, every mount can be made read-only
        assert "noexec-tmpfs" in sandbox, sandbox
    closable = seccomp and ("noexec-tmpfs" in sandbox or any(item.startswith("landlock:") for item in sandbox))
    assert ("comm-open" in sandbox) != closable, sandbox


# ---------------------------------------------------------------- prctl(PR_SET_NAME)

PRCTL = """
thread = threading.Thread(target=lambda: say({"thread": [by_prctl(), by_pthread(libc.pthread_self())]}))
thread.start()
thread.join()
say({"self": [by_prctl(), by_pthread(threading.get_ident())], "name": own_name()})
crash(by_prctl)
crash(lambda: [by_prctl(), by_pthread(libc.pthread_self())], in_thread=True)
"""


@modes
async def test_prctl_set_name_is_refused_and_a_crashing_child_keeps_its_name(mode, kernel_log):
    await require_closed(mode)
    name = chosen_name()
    response, outcomes = await run_named(mode, name, PRCTL)
    assert name not in response.text, response.text
    thread, main, child, child_thread = outcomes
    assert thread == {"thread": ["EPERM", "EPERM"]}
    assert main == {"self": ["EPERM", "EPERM"], "name": BASE_NAME}
    assert child["tried"] == "EPERM" and child_thread["tried"] == ["EPERM", "EPERM"]
    for outcome in (child, child_thread):
        assert outcome["name"] == BASE_NAME and outcome["signal"] == "SIGSEGV", outcome
        assert outcome["comm"] == "EACCES" or set(outcome["comm"]) == {BASE_NAME}, outcome
    assert_nothing_left(response)
    assert_not_logged(kernel_log, name)


# ---------------------------------------------------------------- /proc/<pid>/comm

PROC_COMM = """
waiting = threading.Event()
thread = threading.Thread(target=waiting.wait)
thread.start()
tries = {
    "self": by_proc("/proc/self/comm"),
    "thread-self": by_proc("/proc/thread-self/comm"),
    "other-thread": by_proc(f"/proc/self/task/{thread.native_id}/comm"),
    "pthread": by_pthread(thread.ident),
}
waiting.set()
thread.join()
say({"tries": tries, "comm": comm_of(os.getpid()), "name": own_name()})
crash(lambda: [by_proc("/proc/self/comm"), by_proc("/proc/thread-self/comm")])
crash(lambda: by_proc("/proc/thread-self/comm"), in_thread=True)
"""


@modes
async def test_proc_comm_is_not_writable_and_a_crashing_child_keeps_its_name(mode, kernel_log):
    await require_closed(mode)
    name = chosen_name()
    response, outcomes = await run_named(mode, name, PROC_COMM)
    assert name not in response.text, response.text
    main, child, child_thread = outcomes
    refusal = main["tries"]["self"]
    assert refusal in ("EROFS", "EACCES")  # a read-only /proc, or Landlock
    assert main["tries"] == dict.fromkeys(("self", "thread-self", "other-thread", "pthread"), refusal)
    assert set(main["comm"]) == {BASE_NAME} and main["name"] == BASE_NAME  # the joined thread may linger
    assert child["tried"] == [refusal, refusal] and child_thread["tried"] == refusal
    for outcome in (child, child_thread):
        assert outcome["name"] == BASE_NAME and outcome["signal"] == "SIGSEGV", outcome
        assert outcome["comm"] == "EACCES" or set(outcome["comm"]) == {BASE_NAME}, outcome
    assert_nothing_left(response)
    assert_not_logged(kernel_log, name)


# ---------------------------------------------------------------- executing a file it named

EXECUTE = """
import shutil, subprocess
SOURCES = {"python": sys.executable, "system": shutil.which("sleep")}
ARGS = {"python": ["-c", "import ctypes; ctypes.string_at(0)"], "system": ["0.3"]}

def copy(source, path):
    shutil.copy(source, path)
    os.chmod(path, 0o755)

def make_and_run(make, source, path, args):
    try:
        make(source, path)
    except OSError as exc:
        return "not made " + errno.errorcode[exc.errno]
    try:
        child = subprocess.Popen([f"./{path}", *args])
    except OSError as exc:
        return "not run " + errno.errorcode[exc.errno]
    return ["ran", comm_of(child.pid), child.wait()]

made = {}
for way, make in {"copy": copy, "symlink": os.symlink, "hardlink": os.link}.items():
    for kind, source in SOURCES.items():
        made[f"{way} {kind}"] = make_and_run(make, source, f"{NAME}{way[0]}{kind[0]}", ARGS[kind])
made["hardlink copy"] = make_and_run(os.link, f"{NAME}cp", f"{NAME}hc", ARGS["python"])  # a link to its own copy
memfd = os.memfd_create(NAME)  # fexecve: the kernel names the process after the file, memfd:<NAME>
os.write(memfd, open(sys.executable, "rb").read())
pid = os.fork()
if pid == 0:
    try:
        os.execve(memfd, [sys.executable, *ARGS["python"]], dict(os.environ))
    except OSError as exc:
        say({"memfd": "not run " + errno.errorcode[exc.errno]})
    os._exit(0)
os.waitpid(pid, 0)
say(made)
say({"control": subprocess.run([sys.executable, *ARGS["python"]]).returncode})
"""


@modes
async def test_no_file_it_named_can_be_executed(mode, kernel_log):
    await require_closed(mode)
    name = chosen_name()
    response, outcomes = await run_named(mode, name, EXECUTE)
    assert name not in response.text, response.text
    memfd, made, control = outcomes
    assert memfd == {"memfd": "not run EPERM"}  # seccomp: no execveat(AT_EMPTY_PATH)
    hardlinks = {key: made.pop(key) for key in ("hardlink python", "hardlink system")}
    assert made == {
        "copy python": "not run EACCES",  # noexec, or Landlock
        "copy system": "not run EACCES",
        "symlink python": "not made EPERM",  # seccomp
        "symlink system": "not made EPERM",
        "hardlink copy": "not run EACCES",  # a link lives on its file's mount: writable, so noexec
    }
    assert set(hardlinks.values()) <= {"not made EXDEV", "not made EPERM", "not run EACCES"}, hardlinks  # other mounts
    assert control == {"control": -11}  # the same crash under the interpreter's own name
    assert_nothing_left(response)
    assert_not_logged(kernel_log, name)


# ---------------------------------------------------------------- OOM-killed children

OOM = f"""
import time
kids = []
for _ in range(4):  # each under memory_mb (and RLIMIT_AS); together 2.4 x memory_mb: the cgroup OOM-kills
    pid = os.fork()
    if pid == 0:
        tried = [by_prctl(), by_proc("/proc/self/comm"), by_proc("/proc/thread-self/comm")]
        say({{"tried": tried, "name": own_name()}})
        data = b"x" * int(0.6 * {MEMORY_MB} * 2**20)
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
say([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids])
"""


@modes
async def test_an_oom_killed_child_keeps_its_name(mode, kernel_log):
    await require_closed(mode)
    sandbox = await sandbox_of(mode)
    if any(item.startswith("memory-per-process") for item in sandbox):
        pytest.skip(f"{mode}: no memory cgroup, nothing OOM-kills a call here (sandbox: {sandbox})")
    name = chosen_name()
    response, outcomes = await run_named(mode, name, OOM, memory_mb=MEMORY_MB)
    assert name not in response.text, response.text
    assert response.metrics["oom_killed"] >= 1, response.text
    children = [outcome for outcome in outcomes if isinstance(outcome, dict)]
    assert children, response.text
    for child in children:
        assert child["tried"][0] == "EPERM" and child["tried"][1] in ("EROFS", "EACCES"), child
        assert child["name"] == BASE_NAME
    assert_nothing_left(response)
    messages = assert_not_logged(kernel_log, name)
    assert any("Killed process" in message for message in messages), messages[-5:]


# ---------------------------------------------------------------- what ordinary programs keep

ORDINARY = """
import ctypes, multiprocessing, os, subprocess, sys, threading
print(subprocess.run(["ls", "main.py"], capture_output=True, text=True).stdout.strip())
print(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip())
open("helper.py", "w").write("def double(x):\\n    return 2 * x\\n")
sys.path.insert(0, ".")  # python -I leaves the working directory off sys.path (as before)
import helper
print(helper.double(21))
try:
    with multiprocessing.Pool(2) as pool:
        print(sum(pool.map(abs, [-1, -2, -3])))
except OSError as exc:  # without a mount namespace, Landlock keeps /dev/shm out of reach (as before)
    print(type(exc).__name__)
values = (ctypes.c_int * 3)(3, 1, 2)  # a ctypes callback: libffi's executable trampolines
compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
ctypes.CDLL(None).qsort(values, 3, ctypes.sizeof(ctypes.c_int), compare(lambda a, b: a[0] - b[0]))
print(list(values))
worker = threading.Thread(target=print, args=("thread",), name="worker")
worker.start()
worker.join()
open("run.sh", "w").write("#!/bin/sh\\necho ran\\n")
os.chmod("run.sh", 0o755)
print(subprocess.run(["sh", "run.sh"], capture_output=True, text=True).stdout.strip())
try:
    subprocess.run(["./run.sh"])  # what is lost: executing a file it wrote (noexec, or Landlock)
except PermissionError as exc:
    print("refused", exc.strerror)
"""


@modes
async def test_ordinary_programs_run_as_before_and_a_script_they_write_runs_through_sh(mode):
    await require_closed(mode)
    response = await make_tool(mode).execute("i", {"code": ORDINARY})
    pool = "6" if "mntns" in await sandbox_of(mode) else response.text.splitlines()[3]
    expected = f"main.py\n42\n42\n{pool}\n[1, 2, 3]\nthread\nran\nrefused Permission denied"
    assert response.text == expected, response.text
