"""Threads for the sync calls of code rallyrl does not own (environments, environment classes, function
tools), built so that a call that never returns cannot hang the run.

- **Daemon threads**: the interpreter never joins them, so a command whose work is done exits even
  while a user's ``step`` sleeps for ever (``ThreadPoolExecutor`` and ``asyncio.to_thread`` threads
  are joined at exit).
- **A stuck call frees its place**: ``threads`` calls run at once; a call whose caller stopped waiting
  (its deadline passed, or its request was cancelled) is *stuck*: it keeps its thread but no longer
  counts, and the next call gets a new thread. At most ``max_stuck`` stuck calls per pool: past that,
  a new call is refused at once with an error that names the stuck ones (never a healthy environment
  blamed for a wait behind them).
- **Late returns are handled on the call's own thread**: ``after`` runs a function there once the
  call returns (an environment's close), so it happens even when the event loop that made the call
  has ended. A call's ``BaseException`` (``SystemExit`` in a step) is its result, never the thread's end.
- **One account for the process**: ``stuck_calls()`` names what is still stuck (``environment
  my_pkg:Env``: 3 ``step``), ``wait_for_stuck`` gives stuck calls a last moment to return before the
  command exits, and ``stuck_line()`` is the one line the command prints about the rest.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout.deadlines import within

DEFAULT_MAX_STUCK = 1024

_RUNNING, _RETURNED, _ABANDONED = 0, 1, 2
_registry_lock = threading.Lock()
_registry_changed = threading.Condition(_registry_lock)
_stuck: collections.Counter[tuple[str, str]] = collections.Counter()  # (owner, what) -> calls stuck now
_stuck_until: dict[int, float] = {}  # id of a stuck call -> the monotonic time its own deadline passes


CONTAINED = (Exception, SystemExit, KeyboardInterrupt, GeneratorExit)
"""What a user's code may raise that ends only its own request (``except CONTAINED``): a ``SystemExit``
in a tool's ``execute`` is that call's error, not the end of the run."""


class StuckCallsError(RuntimeError):
    """A pool refused a call: too many of its calls are stuck (the message names them)."""


class UserExit(Exception):
    """A ``SystemExit``, ``KeyboardInterrupt`` or ``GeneratorExit`` that a user's call raised, as an
    ``Exception``: it ends that call's request, never the run."""

    def __init__(self, raised: BaseException):
        super().__init__(f"it raised {type(raised).__name__}({', '.join(map(repr, raised.args))})")
        self.raised = raised


class UserCall:
    """One call on a ``UserThreads`` thread: awaited with ``result``, abandoned when its caller stops waiting."""

    __slots__ = ("_after", "_lock", "_loop", "_outcome", "_slot", "_state", "_waiter", "deadline", "fn", "owner",
                 "pool", "what")  # fmt: skip

    def __init__(self, pool: UserThreads, owner: str, what: str, fn: Callable[[], Any]):
        self.pool, self.owner, self.what, self.fn = pool, owner, what, fn
        self._lock = threading.Lock()
        self._state = _RUNNING
        self._after: list[Callable[[], Any]] = []
        self._outcome: tuple[bool, Any] | None = None  # (raised, value)
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] = self._loop.create_future()
        self.deadline = float("inf")  # monotonic time; set by ``result``
        self._slot = pool._slots  # the semaphore its place was taken from (given back in ``_leave``)

    @property
    def returned(self) -> bool:
        return self._state == _RETURNED

    def after(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn()`` on this call's thread once the call returns; False (``fn`` not taken) when it has."""
        with self._lock:
            if self._state == _RETURNED:
                return False
            self._after.append(fn)
            return True

    @property
    def outcome(self) -> tuple[bool, Any] | None:
        """``(raised, value)`` once the call has returned (or raised), else None."""
        return self._outcome

    async def result(self, timeout_s: float | None, credit: Callable[[float], float] | None = None) -> Any:
        """The call's result (its exception raised; a BaseException as ``UserExit``), waited on for
        ``timeout_s`` at most (None: as long as the caller waits): TimeoutError then, and the call is stuck;
        a cancelled wait leaves it stuck too. ``credit(since)``: seconds the wait may be extended by (the
        event loop's stalls since then)."""
        started = time.monotonic()
        if timeout_s is None:
            try:
                await asyncio.shield(self._waiter)
            except BaseException:  # cancelled: stuck, or (it returned meanwhile) its place given back
                if not self._abandon():
                    self.pool._leave(self._slot, stuck=False)
                raise
            return self._returned()
        self.deadline = started + timeout_s
        while True:
            try:
                await within(asyncio.shield(self._waiter), max(0.0, self.deadline - time.monotonic()))
                break
            except TimeoutError:
                extended = started + timeout_s + (credit(started) if credit is not None else 0.0)
                if extended > time.monotonic() + 0.01 and self._state == _RUNNING:
                    self.deadline = extended
                    continue
                if self._abandon():
                    raise
                break
            except BaseException:  # cancelled: as above
                if not self._abandon():
                    self.pool._leave(self._slot, stuck=False)
                raise
        return self._returned()

    def _returned(self) -> Any:
        self.pool._leave(self._slot, stuck=False)
        raised, value = self._outcome  # type: ignore[misc]
        if raised:
            raise value if isinstance(value, Exception) else UserExit(value)
        return value

    def _abandon(self) -> bool:
        """The caller stops waiting: the call is stuck unless it has returned already (False then)."""
        with self._lock:
            if self._state == _RETURNED:
                return False
            self._state = _ABANDONED
        with _registry_changed:
            _stuck[self.owner, self.what] += 1
            _stuck_until[id(self)] = self.deadline
        self.pool._leave(self._slot, stuck=True)
        return True

    def _run(self) -> None:  # on the call's thread
        try:
            outcome = (False, self.fn())
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, GeneratorExit: the call's, not the thread's
            outcome = (True, exc)
        with self._lock:
            self._outcome, abandoned, self._state = outcome, self._state == _ABANDONED, _RETURNED
            after, self._after = self._after, []
        if abandoned:
            with _registry_changed:
                _stuck[self.owner, self.what] -= 1
                if not _stuck[self.owner, self.what]:
                    del _stuck[self.owner, self.what]
                _stuck_until.pop(id(self), None)
                _registry_changed.notify_all()
            self.pool._returned_late()
        else:
            with contextlib.suppress(RuntimeError):  # (a closed loop: nobody waits any more)
                self._loop.call_soon_threadsafe(_wake, self._waiter)
        for fn in after:
            with contextlib.suppress(BaseException):  # a late close's failure has nobody to go to
                fn()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class UserThreads:
    """Daemon threads for ``name``'s sync calls: ``threads`` run at once; stuck ones do not count (a new
    thread takes their place), up to ``max_stuck`` of them."""

    def __init__(self, name: str, threads: int, max_stuck: int = DEFAULT_MAX_STUCK):
        if threads < 1 or max_stuck < 0:
            raise ValueError(f"{name}: threads must be >= 1 and max_stuck >= 0, got {threads}, {max_stuck}")
        self.name, self.threads, self.max_stuck = name, threads, max_stuck
        self._lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._running = 0  # calls that count against ``threads``
        self.stuck = 0  # calls stuck now (their threads still held)
        self._idle = 0  # threads waiting for a call
        self._calls: queue.SimpleQueue[UserCall | None] = queue.SimpleQueue()
        self.started = 0  # threads started, over the pool's life

    async def start(self, owner: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> UserCall:
        """Start ``fn(*args, **kwargs)`` on a thread once fewer than ``threads`` calls run (the wait is not the
        call's: its deadline starts in ``result``); ``owner`` and ``what`` name it while it is stuck."""
        if self.stuck >= self.max_stuck:
            raise StuckCallsError(f"{owner}: {what} refused: {self.stuck} calls of {self.name} are stuck past their "
                                  f"deadline ({_named()}); no thread is started for more")  # fmt: skip
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # (a semaphore waits on one loop only)
            self._slots, self._slots_loop = asyncio.Semaphore(self.threads), loop
        await self._slots.acquire()
        call = UserCall(self, owner, what, lambda: fn(*args, **kwargs))
        with self._lock:
            self._running += 1
            start = self._idle == 0
            if not start:
                self._idle -= 1
            else:
                self.started += 1
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{self.started}", daemon=True).start()
        self._calls.put(call)
        return call

    async def call(self, owner: str, what: str, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
        """``start`` and ``result`` in one."""
        return await (await self.start(owner, what, fn, *args)).result(timeout_s)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            call._run()
            with self._lock:
                self._idle += 1

    def _leave(self, slot: asyncio.Semaphore | None, stuck: bool) -> None:
        with self._lock:
            self._running -= 1
            self.stuck += stuck
        if slot is not None:
            slot.release()

    def _returned_late(self) -> None:
        with self._lock:
            self.stuck -= 1

    def shutdown(self) -> None:
        """Idle threads end; stuck ones end with their calls (or with the process)."""
        with self._lock:
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._calls.put(None)


def counted(fn: Callable[[], Any], count: Callable[[], None]) -> Callable[[], Any]:
    """``fn`` (sync or async, no arguments) with ``count()`` called once it has run: returned or raised,
    not when cancelled. How a close is counted where it actually ran."""
    if inspect.iscoroutinefunction(fn):

        async def counting() -> Any:
            try:
                result = await fn()
            except asyncio.CancelledError:
                raise
            except BaseException:
                count()
                raise
            count()
            return result

        return counting

    def counting_sync() -> Any:
        try:
            return fn()
        finally:
            count()

    return counting_sync


def run_here(fn: Callable[[], Any]) -> Any:
    """``fn()`` to its end on this thread, where no event loop runs (a late close on a call's thread): a
    coroutine it gives is run here with ``asyncio.run``."""
    result = fn()
    return asyncio.run(_awaiting(result)) if inspect.isawaitable(result) else result


async def _awaiting(awaitable: Any) -> Any:
    return await awaitable


def _named() -> str:
    """The stuck calls, by owner: ``environment x: 3 step, 1 reset; tool y: 1 call``."""
    with _registry_lock:
        items = sorted(_stuck.items())
    owners: dict[str, list[str]] = {}
    for (owner, what), count in items:
        owners.setdefault(owner, []).append(f"{count} {what}")
    return "; ".join(f"{owner}: {', '.join(whats)}" for owner, whats in owners.items())


def stuck_calls() -> dict[tuple[str, str], int]:
    """What is stuck now: (owner, what) -> calls."""
    with _registry_lock:
        return dict(_stuck)


def wait_for_stuck(grace_s: float = 10.0) -> None:
    """Let stuck calls that are still within their own deadline (abandoned by a cancelled request, as by
    Ctrl-C) return, so that what waits for them (an environment's close) runs: at most ``grace_s``."""
    end = time.monotonic() + grace_s
    with _registry_changed:
        while _stuck_until:
            until = min(end, max(_stuck_until.values()))
            if until <= time.monotonic():
                return
            _registry_changed.wait(until - time.monotonic())


def stuck_line() -> str | None:
    """The one line a command prints when calls are still stuck as it ends (None when none is)."""
    named = _named()
    if not named:
        return None
    total = sum(stuck_calls().values())
    return (f"stuck: {total} call(s) into environments or tools never returned and are left running as the "
            f"command exits: {named}")  # fmt: skip
