"""The gateway's table of sessions: the open ones, the newest finished trajectories (``keep_finished``)
and the ids of many more finished sessions (``remember_finished``), which answer 409 and cannot be
opened again; which sessions have expired, and which one gives way when the table is full.

Open sessions are also kept in the order of their last use, and the never-called ones in the order they
were opened, so that finding the expired ones and the one to evict reads from the oldest end and stops at
the first that is not due: a full table of 4,096 sessions is not scanned at every open (which held the
event loop 2-4 ms per open, and ``/health`` over 100 ms, under a flood of opens)."""

from __future__ import annotations

import time
from collections import OrderedDict

from rollout.gateway.errors import GatewayError
from rollout.gateway.session import GatewaySession
from rollout.gateway_config import GatewayConfig
from rollout.request import AsyncRolloutRequest


class SessionTable:
    """Open sessions by id, and what is kept of finished ones (module docstring)."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.open: dict[str, GatewaySession] = {}
        self._by_use: OrderedDict[str, GatewaySession] = OrderedDict()  # open sessions, least recently used first
        self._unused: OrderedDict[str, GatewaySession] = OrderedDict()  # opened over HTTP, not yet called
        self.closing: set[str] = set()  # open sessions being finished: their places are free already
        self.finished: OrderedDict[str, AsyncRolloutRequest] = OrderedDict()  # the newest keep_finished
        self.finished_ids: dict[str, None] = {}  # the newest remember_finished ids, oldest first

    def has_room(self) -> bool:
        return len(self.open) - len(self.closing) < self.config.max_sessions

    def is_finished(self, sid: str) -> bool:
        return sid in self.finished_ids or sid in self.finished

    def knows(self, sid: str) -> bool:
        """Whether ``sid`` names a session, open or finished (and still remembered)."""
        return sid in self.open or self.is_finished(sid)

    def check_new(self, sid: str) -> None:
        """A 409 when ``sid`` is taken: open, or finished and remembered."""
        if sid in self.open:
            raise GatewayError(409, f"session {sid} already exists", "session_exists")
        if self.is_finished(sid):
            raise GatewayError(409, f"session {sid} is finished; a session id is used once", "session_exists")

    def lookup(self, sid: str) -> GatewaySession:
        """The open session ``sid``; 409 if it is finished, 404 if unknown."""
        session = self.open.get(sid)
        if session is None:
            if self.is_finished(sid):
                raise GatewayError(409, f"session {sid} is finished", "session_finished")
            raise GatewayError(404, f"unknown session {sid!r} (POST /sessions opens one)", "session_not_found")
        return session

    def add(self, session: GatewaySession) -> None:
        self.open[session.id] = session
        self._by_use[session.id] = session
        if session.evictable:
            self._unused[session.id] = session

    def touch(self, session: GatewaySession) -> None:
        """``session`` is used now (a call starts or ends)."""
        session.last_used = time.monotonic()
        if session.id in self._by_use:
            self._by_use.move_to_end(session.id)
        if session.id in self._unused:
            self._unused.move_to_end(session.id)

    def closing_now(self, session: GatewaySession) -> None:
        session.closing = True
        self._by_use.pop(session.id, None)  # (never expired or evicted again)
        self._unused.pop(session.id, None)
        if session.id in self.open:
            self.closing.add(session.id)

    def retire(self, session: GatewaySession, request: AsyncRolloutRequest) -> None:
        """``session`` is finished: forgotten as open, its trajectory and id kept (the newest ones)."""
        self.open.pop(session.id, None)
        self._by_use.pop(session.id, None)
        self._unused.pop(session.id, None)
        self.closing.discard(session.id)
        self.finished[session.id] = request
        while len(self.finished) > self.config.keep_finished:
            self.finished.popitem(last=False)
        self.finished_ids[session.id] = None
        while len(self.finished_ids) > self.config.remember_finished:
            del self.finished_ids[next(iter(self.finished_ids))]

    def expired(self, now: float) -> list[tuple[GatewaySession, str]]:
        """The sessions to end, with why: idle for ``session_timeout_s``, or opened over HTTP and never
        called for ``unused_session_timeout_s`` (none with a call in flight or already finishing)."""
        idle, unused = self.config.session_timeout_s, self.config.unused_session_timeout_s
        out: dict[str, tuple[GatewaySession, str]] = {}
        for session in self._due(self._by_use, now - idle):
            out[session.id] = (session, f"the session had no call for {idle:g} s (gateway.session_timeout_s)")
        for session in self._due(self._unused, now - unused):
            out.setdefault(session.id, (session, f"the session was opened and had no call for {unused:g} s "
                                                 "(gateway.unused_session_timeout_s)"))  # fmt: skip
        return list(out.values())

    def oldest_unused(self) -> GatewaySession | None:
        """The session opened over HTTP that has waited longest for its first call (none in flight)."""
        due = self._due(self._unused, float("inf"), first_only=True)
        return due[0] if due else None

    def _due(self, order: OrderedDict[str, GatewaySession], used_before: float, first_only: bool = False
             ) -> list[GatewaySession]:  # fmt: skip
        """The sessions of ``order`` last used before ``used_before``, oldest first, without a call in
        flight. (Sessions called since they went into ``_unused`` leave it here.)"""
        out, called = [], []
        for sid, session in order.items():
            if session.last_used >= used_before:
                break
            if order is self._unused and not session.evictable:
                called.append(sid)
            elif not session.lock.locked():
                out.append(session)
                if first_only:
                    break
        for sid in called:
            del order[sid]
        return out
