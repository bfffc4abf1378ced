"""Timeouts that cost (almost) nothing until one expires.

``with timeout_after(seconds):`` and ``within(coroutine, seconds)`` are ``async with
asyncio.timeout(seconds):`` (around a block, around one coroutine) with the same results,
exceptions and cancellation rules, but cheaper where thousands of requests each wait on a tool
or a server:

- a coroutine that finishes without waiting (a tool's create, calc_reward or release, mostly)
  gets no timer at all;
- one that waits gets an entry in its event loop's ``Deadlines``: a heap of deadlines behind a
  single loop timer set for the earliest. Entering and leaving costs a heap push and a flag,
  where ``asyncio.timeout`` schedules and cancels a timer of its own each time (and the loop's
  timer heap fills with cancelled ones).

When a deadline passes, its task is cancelled and ``within`` turns that cancellation into
``TimeoutError``, exactly as ``asyncio.timeout`` does (a cancellation from elsewhere passes through).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import types
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


_OPEN, _CLOSED, _EXPIRED = 0, 1, 2
_Entry = list  # [when, order, task, status]: one list per deadline, the heap's entry and the caller's handle


class Deadlines:
    """The deadlines of one event loop, behind one timer set for the earliest that is still open."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._heap: list[_Entry] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._closed = 0  # closed entries still in the heap

    def __len__(self) -> int:
        """Deadlines still open."""
        return sum(entry[3] == _OPEN for entry in self._heap)

    def open(self, when: float, task: asyncio.Task[Any]) -> _Entry:
        """Cancel ``task`` at loop time ``when`` unless closed before."""
        entry = [when, next(self._order), task, _OPEN]
        heapq.heappush(self._heap, entry)
        if when < self._timer_at:
            self._arm(when)
        return entry

    def close(self, entry: _Entry) -> bool:
        """Done with ``entry``; whether it had expired (its task was cancelled for it)."""
        if entry[3] != _OPEN:
            return entry[3] == _EXPIRED
        entry[3] = _CLOSED
        entry[2] = None  # (the task is not kept alive by a closed entry)
        self._closed += 1
        if self._closed > 256 and 2 * self._closed > len(self._heap):  # drop them (amortised O(1) each)
            self._heap = [entry for entry in self._heap if entry[3] == _OPEN]
            heapq.heapify(self._heap)
            self._closed = 0
        return False

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        heap, now = self._heap, self.loop.time()
        while heap and (heap[0][0] <= now or heap[0][3] != _OPEN):
            entry = heapq.heappop(heap)
            if entry[3] != _OPEN:
                self._closed -= 1
            else:
                entry[3] = _EXPIRED
                entry[2].cancel()
        if heap:
            self._arm(heap[0][0])


_books: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = weakref.WeakKeyDictionary()
_last: tuple[weakref.ReferenceType[asyncio.AbstractEventLoop], Deadlines] | None = None


def deadlines(loop: asyncio.AbstractEventLoop) -> Deadlines:
    """``loop``'s deadlines (made on first use)."""
    global _last
    if _last is not None and _last[0]() is loop:
        return _last[1]
    book = _books.get(loop)
    if book is None:
        book = _books[loop] = Deadlines(loop)
    _last = (weakref.ref(loop), book)
    return book


class timeout_after:
    """``with timeout_after(seconds): ...await...`` in a task: what ``async with asyncio.timeout(seconds)``
    does, through the loop's ``Deadlines`` (no timer of its own, no coroutine to enter or leave)."""

    __slots__ = ("_book", "_cancelling", "_deadline", "_seconds", "_task")

    def __init__(self, seconds: float):
        self._seconds = seconds

    def __enter__(self) -> timeout_after:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("timeout_after is used inside a task")
        self._book = deadlines(loop)
        self._deadline = self._book.open(loop.time() + self._seconds, task)
        self._task, self._cancelling = task, task.cancelling()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: Any) -> None:
        # expired: the cancellation was ours, and is taken back (as asyncio.timeout does)
        expired = self._book.close(self._deadline)
        if expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


async def within(awaitable: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``await awaitable`` with a timeout of ``timeout_s``, counted from now (TimeoutError when it
    passes). A coroutine that finishes without waiting costs no deadline."""
    loop = asyncio.get_running_loop()
    when = loop.time() + timeout_s
    if not isinstance(awaitable, types.CoroutineType):  # another awaitable: the plain way
        async with asyncio.timeout_at(when):
            return await awaitable
    try:
        waiting_on = awaitable.send(None)
    except StopIteration as done:
        return done.value
    with timeout_after(when - loop.time()):
        return await _resumed(awaitable, waiting_on)


@types.coroutine
def _resumed(coroutine: Coroutine[Any, Any, T], waiting_on: Any) -> Any:
    """Go on with ``coroutine``, which has handed ``waiting_on`` to the event loop: what
    ``await coroutine`` does from there (results and exceptions, cancellation included, pass through)."""
    while True:
        try:
            sent = yield waiting_on
        except BaseException as exc:
            try:
                waiting_on = coroutine.throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                waiting_on = coroutine.send(sent)
            except StopIteration as done:
                return done.value
