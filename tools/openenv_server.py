"""OpenEnv servers that rallyrl starts itself, on loopback, for the environments named by import path.

``openenv:my_pkg.envs:MyEnv`` (an interaction's environment) or ``app: my_pkg.envs:MyEnv`` (an MCP
environment as tools) names one of:

    an ``Environment`` subclass     served by openenv's ``create_app(Env, ActionCls, ObservationCls)``; the
                                    classes come from ``action_cls`` / ``observation_cls`` (import paths),
                                    else from the class's generic parameters or its ``step`` annotations
                                    (``CallToolAction`` / ``CallToolObservation`` for an ``MCPEnvironment``)
    an ASGI app                     ``my_pkg.server:app`` (a module alone means its ``app``), served as it is
    a function                      called with no arguments, it returns the app (uvicorn's ``--factory``)

Each server is a uvicorn subprocess (``python -m tools.openenv_server``) on a socket this process
binds on 127.0.0.1 with a free port and hands over, so no other process can take the port in between.
Servers are started lazily, once per (owner, target, options) and process, waited for (``/health``)
under a deadline, and stopped at exit (``stop_local_servers``; also by ``atexit``); a server whose
process exited is started again for the next episode (at most ``MAX_RESTARTS`` times). The child exits
by itself when this process dies, so no server outlives its rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import inspect
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
"""How long a started server may take to answer ``/health`` (openenv and its web stack import slowly)."""
STOP_TIMEOUT_S = 5.0
"""How long a stopped server may take to exit after SIGTERM before it is killed."""
MAX_RESTARTS = 3
"""How many times a server whose process exited is started again before its episodes fail for good."""
LOG_TAIL_CHARS = 2000


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://", "ws://", "wss://"))


@dataclass
class LocalServer:
    """One uvicorn subprocess serving ``target`` on ``url``; its output goes to ``log_path``."""

    target: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    stopped: bool = False

    def exit_code(self) -> int | None:
        """The process's exit code, or None while it runs."""
        return self.process.poll()

    def describe(self, when: str = "") -> str:
        """Where the server is, and when it has exited, how it ended and the end of its log."""
        where = f"the OpenEnv server of {self.target} at {self.url} (pid {self.process.pid})"
        code = self.exit_code()
        if code is None or self.stopped:
            return where
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        tail = self.log_tail()
        return f"{where} exited{when} ({how})" + (f"; the end of its log ({self.log_path}):\n{tail}" if tail else "")

    def log_tail(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_CHARS))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``STOP_TIMEOUT_S``."""
        self.stopped = True
        if self.process.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(STOP_TIMEOUT_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.process.wait()


async def died(server: LocalServer | None, exc: BaseException) -> bool:
    """Whether the call that raised ``exc`` failed because ``server``'s process exited: after a lost
    connection the exit is given a second to be seen (the socket closes as the process dies)."""
    if server is None:
        return False
    from websockets.exceptions import ConnectionClosed

    waits = 20 if isinstance(exc, ConnectionClosed | ConnectionError | OSError) else 0
    for _ in range(waits):
        if server.exit_code() is not None:
            break
        await asyncio.sleep(0.05)
    return server.exit_code() is not None


@dataclass
class _Slot:
    server: LocalServer | None = None
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_slots: dict[tuple[str, str, tuple[tuple[str, str], ...], tuple[str, ...]], _Slot] = {}
_slots_lock = threading.Lock()
_log_dir: Path | None = None


def local_server(target: str, owner: str, timeout_s: float = START_TIMEOUT_S, paths: tuple[str, ...] = (),
                 **options: Any) -> LocalServer:  # fmt: skip
    """The running server of ``target`` for ``owner`` (``"env"``, ``"tools"``): started on first use,
    started again when its process has exited. ``paths`` are searched for ``target``'s module first;
    ``options`` (``action_cls``, ``observation_cls``, ``max_sessions``) go to the server. Blocking: call
    it from a worker thread inside an event loop."""
    opts = tuple(sorted((k, str(v)) for k, v in options.items() if v is not None))
    with _slots_lock:
        slot = _slots.setdefault((owner, target, opts, paths), _Slot())
    with slot.lock:
        server = slot.server
        if server is not None and server.exit_code() is None:
            return server
        if server is not None:
            if slot.restarts >= MAX_RESTARTS:
                raise RuntimeError(f"{server.describe()}\nIt was started {slot.restarts + 1} times; not again.")
            slot.restarts += 1
            log.warning("%s; starting it again (%d of %d)", server.describe(), slot.restarts, MAX_RESTARTS)
        slot.server = _start(target, dict(opts), timeout_s, paths)
        return slot.server


def stop_local_servers(owner: str | None = None) -> None:
    """Stop every server started for ``owner`` (all of them when None); a later episode starts it again."""
    with _slots_lock:
        slots = [slot for key, slot in _slots.items() if owner is None or key[0] == owner]
    for slot in slots:
        with slot.lock:
            if slot.server is not None:
                slot.server.stop()
                slot.server = None
            slot.restarts = 0


def _stop_all_at_exit() -> None:
    stop_local_servers()
    if _log_dir is not None:
        shutil.rmtree(_log_dir, ignore_errors=True)


atexit.register(_stop_all_at_exit)


def _start(target: str, options: dict[str, str], timeout_s: float, paths: tuple[str, ...]) -> LocalServer:
    global _log_dir
    if _log_dir is None:
        _log_dir = Path(tempfile.mkdtemp(prefix="rallyrl-openenv-"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
        port = sock.getsockname()[1]
        log_path = _log_dir / f"{target.replace(':', '_').replace('/', '_')}-{port}.log"
        args = [sys.executable, "-m", "tools.openenv_server", target, "--fd", str(sock.fileno()),
                "--parent", str(os.getpid())]  # fmt: skip
        for key, value in options.items():
            args += [f"--{key.replace('_', '-')}", value]
        search = [str(Path(__file__).resolve().parents[1]), *paths, os.getcwd(), *sys.path]  # this rallyrl first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in search if p)}
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                       pass_fds=(sock.fileno(),), env=env, start_new_session=True)  # fmt: skip
    finally:
        sock.close()  # the child holds its own copy
    server = LocalServer(target, f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_ready(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: LocalServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:  # a request waits in the backlog until uvicorn serves
        while True:
            if server.exit_code() is not None:
                raise RuntimeError(server.describe(" before it was ready"))
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.describe()} did not answer /health within {timeout_s:g} s")
            time.sleep(0.1)


# ----- the child: build the app and serve it on the socket it was handed ---------------------------


def build_app(target: str, action_cls: str | None = None, observation_cls: str | None = None,
              max_sessions: int | None = None) -> Any:  # fmt: skip
    """The ASGI app that serves ``target`` (see the module docstring)."""
    from openenv.core import Environment, create_app

    from tools.loading import import_class

    obj = import_class(target if ":" in target else f"{target}:app")
    if isinstance(obj, type) and issubclass(obj, Environment):
        action, observation = _io_classes(obj, action_cls, observation_cls)
        if max_sessions is None:
            max_sessions = 256 if getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
        return create_app(obj, action, observation, max_concurrent_envs=max_sessions)
    if action_cls or observation_cls or max_sessions is not None:
        raise TypeError(f"{target}: action_cls, observation_cls and max_sessions are for an Environment class")
    if inspect.isfunction(obj):
        return obj()
    return obj


def _io_classes(env: type, action_cls: str | None, observation_cls: str | None) -> tuple[type, type]:
    """The Action and Observation classes of an Environment class: given, else read off the class."""
    from openenv.core import Action, CallToolAction, CallToolObservation, MCPEnvironment, Observation

    from tools.loading import import_class

    found: list[type | None] = [None, None]
    if MCPEnvironment is not None and issubclass(env, MCPEnvironment):
        found = [CallToolAction, CallToolObservation]
    for base in env.__mro__:  # Environment[MyAction, MyObservation, MyState]
        for generic in getattr(base, "__orig_bases__", ()):
            args = [a for a in typing.get_args(generic) if isinstance(a, type)]
            found[0] = found[0] or next((a for a in args if issubclass(a, Action)), None)
            found[1] = found[1] or next((a for a in args if issubclass(a, Observation)), None)
    try:  # def step(self, action: MyAction) -> MyObservation
        hints = typing.get_type_hints(env.step)
        found[0] = found[0] or next((h for h in hints.values() if isinstance(h, type) and issubclass(h, Action)), None)
        returned = hints.get("return")
        if isinstance(returned, type) and issubclass(returned, Observation):
            found[1] = found[1] or returned
    except Exception:
        pass
    action = import_class(action_cls) if action_cls else found[0]
    observation = import_class(observation_cls) if observation_cls else found[1]
    if action is None or observation is None:
        raise TypeError(
            f"{env.__module__}.{env.__qualname__}: cannot tell its Action and Observation classes; "
            "give them as action_cls and observation_cls (import paths) in the environment's kwargs"
        )
    return action, observation


def _exit_with_parent(parent: int) -> None:
    """Exit when the process that started this server is gone (killed without running its atexit)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def _import_openenv_without_web_ui() -> None:
    """openenv.core imports gradio (seconds) for a web UI that only ``ENABLE_WEB_INTERFACE`` turns on: without
    it, import openenv with gradio held back (openenv falls back by itself), then let the app import gradio."""
    if os.environ.get("ENABLE_WEB_INTERFACE", "").lower() in ("true", "1", "yes") or "gradio" in sys.modules:
        return
    sys.modules["gradio"] = None  # type: ignore[assignment]  # import gradio: ModuleNotFoundError
    try:
        import openenv.core  # noqa: F401
    finally:
        del sys.modules["gradio"]


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve an OpenEnv environment on a socket handed over by rallyrl")
    parser.add_argument("target")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--action-cls")
    parser.add_argument("--observation-cls")
    parser.add_argument("--max-sessions", type=int)
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    _import_openenv_without_web_ui()
    app = build_app(args.target, args.action_cls, args.observation_cls, args.max_sessions)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[socket.socket(fileno=args.fd)])


if __name__ == "__main__":
    main()
