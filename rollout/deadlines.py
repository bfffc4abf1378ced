"""Timeouts that cost (almost) nothing until one expires.

``within(coroutine, seconds)`` is ``async with asyncio.timeout(seconds): await coroutine``, with the
same result, exceptions and cancellation rules, but cheaper where thousands of requests each wait
on a tool:

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


class _Deadline:
    __slots__ = ("closed", "expired", "task")

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task
        self.expired = False
        self.closed = False


class Deadlines:
    """The deadlines of one event loop, behind one timer set for the earliest that is still open."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._closed = 0  # closed entries still in the heap

    def __len__(self) -> int:
        """Deadlines still open."""
        return len(self._heap) - self._closed

    def open(self, when: float, task: asyncio.Task[Any]) -> _Deadline:
        """Cancel ``task`` at loop time ``when`` unless closed before."""
        deadline = _Deadline(task)
        heapq.heappush(self._heap, (when, next(self._order), deadline))
        if when < self._timer_at:
            self._arm(when)
        return deadline

    def close(self, deadline: _Deadline) -> bool:
        """Done with ``deadline``; whether it had expired (its task was cancelled for it)."""
        if deadline.expired or deadline.closed:
            return deadline.expired
        deadline.closed = True
        self._closed += 1
        if self._closed > 256 and 2 * self._closed > len(self._heap):  # drop them (amortised O(1) each)
            self._heap = [entry for entry in self._heap if not entry[2].closed]
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
        while heap and (heap[0][0] <= now or heap[0][2].closed):
            _, _, deadline = heapq.heappop(heap)
            if deadline.closed:
                self._closed -= 1
            else:
                deadline.expired = True
                deadline.task.cancel()
        if heap:
            self._arm(heap[0][0])


_books: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = weakref.WeakKeyDictionary()


def deadlines(loop: asyncio.AbstractEventLoop) -> Deadlines:
    """``loop``'s deadlines (made on first use)."""
    book = _books.get(loop)
    if book is None:
        book = _books[loop] = Deadlines(loop)
    return book


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
    task = asyncio.current_task(loop)
    if task is None:  # not in a task: nothing to cancel, the plain way
        async with asyncio.timeout_at(when):
            return await _resumed(awaitable, waiting_on)
    book = deadlines(loop)
    deadline = book.open(when, task)
    cancelling = task.cancelling()
    try:
        result = await _resumed(awaitable, waiting_on)
    except BaseException as exc:
        if book.close(deadline) and task.uncancel() <= cancelling and isinstance(exc, asyncio.CancelledError):
            raise TimeoutError from exc
        raise
    if book.close(deadline):  # expired as it finished: the cancellation is taken back, as asyncio.timeout does
        task.uncancel()
    return result


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
