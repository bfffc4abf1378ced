"""Opening, ending and expiring the agent gateway's sessions (``SessionLifecycle``, which ``Gateway``
extends): the table's room made when it is full (expired sessions first, then the one waiting longest
for its first call), sessions ended one at a time in the background, and idle ones expired."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from data.reward_fns import RewardFn
from rollout.config import GatewayConfig, RolloutConfig
from rollout.gateway.errors import GatewayError
from rollout.gateway.limits import check_session_id
from rollout.gateway.offload import OffLoop
from rollout.gateway.registry import SessionTable
from rollout.gateway.session import GatewaySession, RecordFactory, new_session_id
from rollout.loop import score_request
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState

logger = logging.getLogger("rollout.gateway.app")

TRIM_AFTER_SESSIONS = 64
"""When this many sessions end together, their memory is given back to the OS (``offload.py``)."""


class SessionLifecycle:
    """The sessions of a gateway, from open to finished (module docstring)."""

    config: GatewayConfig
    rollout: RolloutConfig
    reward_fn: RewardFn
    on_finish: Callable[[AsyncRolloutRequest], None] | None
    counters: dict[str, int]

    def __init__(self) -> None:
        self.table = SessionTable(self.config)
        self.sessions = self.table.open
        self.finished = self.table.finished  # the newest keep_finished trajectories
        self._offload = OffLoop()
        self._to_end: deque[tuple[GatewaySession, str]] = deque()  # sessions to end as aborted, and why
        self._ender: asyncio.Task[None] | None = None

    def open_session(self, request: AsyncRolloutRequest | RecordFactory | None = None, session_id: str | None = None,
                     rollout: RolloutConfig | None = None, held: bool = True) -> GatewaySession:  # fmt: skip
        """A new session recording into ``request`` (a fresh one by default, or one built at its first use
        by a ``RecordFactory``), under ``rollout``'s limits.
        ``held``: opened in-process by its driver, which ends it (never ended for want of a first call)."""
        session_id = new_session_id() if session_id is None else check_session_id(session_id)
        self.table.check_new(session_id)
        if not self.table.has_room():
            self._make_room()
        if not self.table.has_room():
            raise GatewayError(429, f"{len(self.sessions)} sessions are open, the most gateway.max_sessions allows, "
                                    "and each has made a call; finish some first", "too_many_sessions")  # fmt: skip
        if request is None:
            request = AsyncRolloutRequest(request_id=session_id, prompt_index=0, sample_index=0, messages=[])
        session = GatewaySession(session_id, request, rollout or self.rollout, self.config.sampling, held)
        self.table.add(session)
        self.counters["sessions_opened"] += 1
        return session

    def _make_room(self) -> None:
        """The table is full: end the expired sessions, else the one that has waited longest for its first call."""
        now = time.monotonic()
        for session, why in self.table.expired(now):
            self._end(session, why, "sessions_expired")
        if not self.table.has_room() and (oldest := self.table.oldest_unused()) is not None:
            why = (f"gateway.max_sessions ({self.config.max_sessions}) sessions were open: this one, opened "
                   f"{now - oldest.last_used:.1f} s before and never called, gave way to a new one")  # fmt: skip
            self._end(oldest, why, "sessions_evicted")

    def _end(self, session: GatewaySession, error: str, counter: str) -> None:
        """End ``session`` as aborted in the background; its place is free at once."""
        self.counters[counter] += 1
        self.table.closing_now(session)
        self._to_end.append((session, error))
        if self._ender is None or self._ender.done():
            self._ender = asyncio.create_task(self._end_queued())

    async def _end_queued(self) -> None:
        """End the sessions ``_end`` queued, one at a time with the event loop between them (thousands
        expiring together must not hold ``/health``), then give their memory back if they were many."""
        ended = 0
        while self._to_end:
            session, error = self._to_end.popleft()
            try:
                await self.finish_session(session, reason=FinishReason.ABORT, error=error)
            except Exception:  # (on_finish failed: the session is finished all the same)
                logger.exception("ending session %s failed", session.id)
            ended += 1
            await asyncio.sleep(0)
        if ended >= TRIM_AFTER_SESSIONS:
            self._offload.trim_soon()

    async def finish_session(self, session: GatewaySession, *, reason: FinishReason | None = None,
                             error: str | None = None, reward: float | None = None) -> AsyncRolloutRequest:  # fmt: skip
        """End a session once: its finish reason, reward (posted, else ``reward``, else the reward
        function), the token check of its last sample; then hand it to ``on_finish`` and free it."""
        self.table.closing_now(session)
        async with session.lock:  # after the call in flight, if any
            if session.finished:
                return session.request
            request = session.request
            if request.rewards.posted is None and reward is not None:
                request.rewards.posted = reward
            if error is not None or reason is not None:
                request.finish(reason or FinishReason.ERROR, error)
            elif session.refused is not None:  # its last call was refused: a budget was spent
                request.finish(*session.refused)
            elif session.calls == 0:
                request.finish(FinishReason.ERROR, "the agent made no call through the gateway")
            else:
                request.finish(session.end_reason())
            if request.state is not RequestState.COMPLETED:
                request.transition(RequestState.COMPLETED)
            posted = request.rewards.posted

            def reward_fn(r: AsyncRolloutRequest) -> Any:
                return posted if posted is not None else self.reward_fn(r)

            try:  # (a session with no call has no tokens to check)
                await score_request(request, [], session.chat, session.config, reward_fn,  # type: ignore[arg-type]
                                    session.transcript)  # fmt: skip
            finally:
                session.finished = True
                self.table.retire(session, request)
                self.counters["sessions_finished"] += 1
                self.counters["samples_split"] += len(request.segments)
                session.chat = session.transcript = None
                if session.heavy:
                    self._offload.trim_soon()
        if self.on_finish is not None:
            self.on_finish(request)
        return request

    async def _expire_idle(self) -> None:
        """End sessions with no call for ``session_timeout_s``, and those opened over HTTP and never called
        for ``unused_session_timeout_s`` (their agent is gone)."""
        config = self.config
        while True:
            await asyncio.sleep(min(5.0, config.session_timeout_s / 4, config.unused_session_timeout_s / 4))
            for session, why in self.table.expired(time.monotonic()):
                self._end(session, why, "sessions_expired")
