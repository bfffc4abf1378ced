"""The gateway's table of sessions: the open ones, the newest finished trajectories (``keep_finished``)
and the ids of many more finished sessions (``remember_finished``), which answer 409 and cannot be
opened again; which sessions have expired, and which one gives way when the table is full."""

from __future__ import annotations

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

    def closing_now(self, session: GatewaySession) -> None:
        session.closing = True
        if session.id in self.open:
            self.closing.add(session.id)

    def retire(self, session: GatewaySession, request: AsyncRolloutRequest) -> None:
        """``session`` is finished: forgotten as open, its trajectory and id kept (the newest ones)."""
        self.open.pop(session.id, None)
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
        out = []
        for session in self.open.values():
            if session.lock.locked() or session.closing:
                continue
            waited = now - session.last_used
            if waited > idle:
                out.append((session, f"the session had no call for {idle:g} s (gateway.session_timeout_s)"))
            elif session.evictable and waited > unused:
                out.append((session, f"the session was opened and had no call for {unused:g} s "
                                     "(gateway.unused_session_timeout_s)"))  # fmt: skip
        return out

    def oldest_unused(self) -> GatewaySession | None:
        """The session opened over HTTP that has waited longest for its first call (none in flight)."""
        waiting = [s for s in self.open.values() if s.evictable and not s.lock.locked() and not s.closing]
        return min(waiting, key=lambda s: s.last_used, default=None)
