"""An executor of daemon threads, for calls that may never return: a collective whose peer is gone
(NCCL has no deadline of its own), a rendezvous that waits for ranks that never come.

``asyncio.to_thread`` and ``ThreadPoolExecutor`` run on threads the interpreter joins at exit, and
share them with everything else the event loop hands to its default executor; a call stuck there
holds a thread other work needs and keeps the process alive after ``main`` returns. A
``DaemonThreads`` has threads of its own, never joined: a caller bounds its wait with
``asyncio.timeout``, and a call still stuck after that holds only its own thread. ``max_workers=1``
runs calls one after another, in order (the collectives of one process group must be issued so).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonThreads(Executor):
    """At most ``max_workers`` daemon threads named ``name``, started as calls come; ``busy`` counts the
    calls submitted and not yet finished (a stuck one stays counted)."""

    def __init__(self, max_workers: int, name: str):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._busy = 0
        self._shutdown = False

    @property
    def busy(self) -> int:
        return self._busy

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self.name}: submit after shutdown")
            self._busy += 1
            if len(self._threads) < min(self.max_workers, self._busy):
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = call()
                    except BaseException as exc:  # (handed to the caller, as an executor does)
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._busy -= 1

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; idle threads end (a stuck one ends with the process). Never waits."""
        with self._lock:
            self._shutdown = True
            threads = len(self._threads)
        for _ in range(threads):
            self._calls.put(None)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of these threads, awaited (cancelling the wait leaves the call running)."""
        return await asyncio.wrap_future(self.submit(fn, *args))


def start_once(name: str, fn: Callable[..., T], *args: Any) -> Future[T]:
    """Start ``fn(*args)`` on a daemon thread of its own, which ends with the call (a stuck call holds only it)."""
    threads = DaemonThreads(1, name)
    future = threads.submit(fn, *args)
    threads.shutdown()
    return future


async def run_once(name: str, fn: Callable[..., T], *args: Any) -> T:
    """``start_once``, awaited."""
    return await asyncio.wrap_future(start_once(name, fn, *args))
