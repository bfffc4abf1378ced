"""Awaiting a coroutine of code rallyrl does not own (an environment's ``async def step``): its
``BaseException``s kept in its request, and the event loop's stalls it causes put on its account.

``run_user(coroutine, owner, what)`` drives the coroutine one slice at a time (each run between two
awaits), which costs a clock read per slice. A ``SystemExit``, ``KeyboardInterrupt`` or
``GeneratorExit`` it raises comes out as a ``UserExit`` (an ``Exception``: it ends the request, not
the run). A slice longer than ``STALL_S`` is a *stall*: the coroutine blocked the loop (``time.sleep``,
blocking I/O inside ``async def``) and every other request with it. A stall is recorded with its
culprit, and:

- ``BlockedLoop`` ends the culprit's call once one slice has outlasted the call's own deadline;
- ``stalled(since, now, exclude)`` says how long the loop was blocked by others while a call waited,
  so that a healthy call's deadline is moved by as much, and a call that still times out names the
  culprit (``stall_note``).
"""

from __future__ import annotations

import collections
import threading
import time
import types
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout.user_threads import UserExit

T = TypeVar("T")

STALL_S = 0.25
"""A slice of a user's coroutine longer than this blocked the event loop: it is recorded."""
_KEPT = 4096  # stalls remembered (the oldest go first)


@dataclass(frozen=True)
class Stall:
    start: float  # time.monotonic()
    end: float
    owner: str
    what: str
    token: object  # the call that stalled


class BlockedLoop(RuntimeError):
    """A user's coroutine blocked the event loop for longer than its call's deadline."""


_stalls: collections.deque[Stall] = collections.deque(maxlen=_KEPT)
_lock = threading.Lock()


def stalled(since: float, now: float, exclude: object = None) -> tuple[float, list[Stall]]:
    """Seconds in ``[since, now]`` during which the loop was blocked by a call other than ``exclude``,
    and those stalls."""
    with _lock:
        hits = [s for s in _stalls if s.end > since and s.start < now and s.token is not exclude]
    return sum(min(s.end, now) - max(s.start, since) for s in hits), hits


def stall_note(stalls: list[Stall]) -> str:
    """``while the event loop was blocked 4.0 s by environment x's step``, for an error message."""
    if not stalls:
        return ""
    worst = max(stalls, key=lambda s: s.end - s.start)
    total = sum(s.end - s.start for s in stalls)
    return f" (the event loop was blocked {total:.1f} s meanwhile, by {worst.owner}'s {worst.what})"


async def run_user(
    coroutine: Coroutine[Any, Any, T], owner: str, what: str, timeout_s: float, token: object = None
) -> T:
    """``await coroutine``, slice by slice: BaseExceptions as ``UserExit``, stalls recorded (under
    ``token``: ``stalled(..., exclude=token)`` leaves them out), and a ``BlockedLoop`` when one slice
    outlasts ``timeout_s``."""
    token = object() if token is None else token
    try:
        return await _sliced(coroutine, owner, what, timeout_s, token)
    except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
        raise UserExit(exc) from None


@types.coroutine
def _sliced(coroutine: Coroutine[Any, Any, T], owner: str, what: str, timeout_s: float, token: object) -> Any:
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        started = time.monotonic()
        try:
            waiting_on = coroutine.send(sent) if thrown is None else coroutine.throw(thrown)
        except StopIteration as done:
            _slice(started, owner, what, timeout_s, token)
            return done.value
        except BaseException:
            _slice(started, owner, what, timeout_s, token, raising=True)
            raise
        try:
            _slice(started, owner, what, timeout_s, token)
        except BlockedLoop:
            coroutine.close()
            raise
        sent, thrown = None, None
        try:
            sent = yield waiting_on
        except BaseException as exc:  # cancellation, passed on into the coroutine
            thrown = exc


def _slice(started: float, owner: str, what: str, timeout_s: float, token: object, raising: bool = False) -> None:
    ended = time.monotonic()
    if ended - started < STALL_S:
        return
    with _lock:
        _stalls.append(Stall(started, ended, owner, what, token))
    if ended - started > timeout_s and not raising:
        raise BlockedLoop(
            f"{owner}: {what} blocked the event loop for {ended - started:.1f} s, over its {timeout_s:g} s deadline: "
            "an async method must not block (run blocking work with asyncio.to_thread, or make the method sync)"
        )
