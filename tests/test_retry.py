"""One retry rule (``rollout/retry.py``): exponential backoff with full jitter, and the retry loop
that the HTTP client and the judge share."""

from __future__ import annotations

import random

import pytest

from rollout.retry import Backoff, call_with_retries

FAST = Backoff(base_s=0.001, max_s=0.002)


def test_the_delay_is_full_jitter_under_a_doubling_cap(monkeypatch):
    backoff = Backoff(base_s=0.25, max_s=1.0)
    monkeypatch.setattr(random, "uniform", lambda low, high: (low, high))
    assert [backoff.delay(n) for n in range(4)] == [(0, 0.25), (0, 0.5), (0, 1.0), (0, 1.0)]


def test_delays_stay_within_their_cap():
    backoff = Backoff(base_s=0.1, max_s=0.3)
    assert all(0 <= backoff.delay(n) <= min(0.3, 0.1 * 2**n) for n in range(6) for _ in range(50))


async def test_a_retryable_failure_is_retried_until_an_attempt_passes():
    calls, retried = [], []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    result = await call_with_retries(attempt, retries=5, backoff=FAST, retry_on=(ConnectionError,),
                                     on_retry=retried.append)  # fmt: skip
    assert result == "ok" and len(calls) == 3 and len(retried) == 2


async def test_the_last_failure_is_raised_after_every_retry():
    calls = []

    async def attempt() -> None:
        calls.append(1)
        raise ConnectionError(f"attempt {len(calls)}")

    with pytest.raises(ConnectionError, match="attempt 3"):
        await call_with_retries(attempt, retries=2, backoff=FAST, retry_on=(ConnectionError,))
    assert len(calls) == 3


async def test_another_failure_is_raised_at_once():
    calls = []

    async def attempt() -> None:
        calls.append(1)
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        await call_with_retries(attempt, retries=5, backoff=FAST, retry_on=(ConnectionError,))
    assert len(calls) == 1
