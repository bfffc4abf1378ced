"""The gateway's session table keeps its sessions in order of use (``rollout/gateway/registry.py``): the
expired ones and the one to evict are found from the oldest end, a session's first call takes it out
of the evictable ones, and one that is finishing is neither expired nor evicted again."""

from __future__ import annotations

import time

from rollout.config import RolloutConfig
from rollout.gateway.registry import SessionTable
from rollout.gateway.session import GatewaySession
from rollout.gateway_config import GatewayConfig
from rollout.request import AsyncRolloutRequest


def table_with(count: int, **config: float) -> tuple[SessionTable, list[GatewaySession]]:
    table = SessionTable(GatewayConfig(**config))
    sessions = []
    for i in range(count):
        request = AsyncRolloutRequest(request_id=f"s{i}", prompt_index=0, sample_index=0, messages=[])
        session = GatewaySession(f"s{i}", request, RolloutConfig(), "rollout", held=False)
        session.last_used = session.opened_at = 100.0 + i  # opened a second apart
        table.add(session)
        sessions.append(session)
    return table, sessions


def test_the_oldest_never_called_session_gives_way_and_a_called_one_never():
    table, (a, b, c) = table_with(3)
    assert table.oldest_unused() is a
    a.calls = 1  # its first call was answered
    assert table.oldest_unused() is b
    table.closing_now(b)
    assert table.oldest_unused() is c
    table.retire(c, c.request)
    assert table.oldest_unused() is None and set(table.open) == {"s0", "s1"}


def test_expiry_reads_the_order_of_use_and_skips_sessions_in_flight():
    table, (a, b, c) = table_with(3, session_timeout_s=10.0, unused_session_timeout_s=5.0)
    for session in (a, b, c):
        session.calls = 1
    table.touch(a)  # a call now: a is the newest
    now = time.monotonic()
    b.last_used, c.last_used = now - 20, now - 11
    assert [s.id for s, _ in table.expired(now)] == ["s1", "s2"]
    assert "gateway.session_timeout_s" in table.expired(now)[0][1]
    assert [s.id for s, _ in table.expired(now - 10)] == []


def test_a_never_called_session_expires_after_the_unused_timeout_once():
    table, (a, _) = table_with(2, session_timeout_s=10.0, unused_session_timeout_s=5.0)
    now = a.last_used + 12  # a idle for 12 s (both timeouts), b for 11 s
    reasons = {s.id: why for s, why in table.expired(now)}
    assert list(reasons) == ["s0", "s1"] and "gateway.session_timeout_s" in reasons["s0"]
    assert [s.id for s, _ in table.expired(a.last_used + 6)] == ["s0"]
    assert "gateway.unused_session_timeout_s" in table.expired(a.last_used + 6)[0][1]


def test_a_session_opened_over_http_builds_its_record_at_first_use():
    built = []

    def record(opened_at: float) -> AsyncRolloutRequest:
        built.append(opened_at)
        return AsyncRolloutRequest(request_id="lazy", prompt_index=0, sample_index=0, messages=[])

    session = GatewaySession("lazy", record, RolloutConfig(), "rollout", held=False)
    assert built == []
    assert session.request.request_id == "lazy" and session.request is session.request
    assert built == [session.opened_at]
