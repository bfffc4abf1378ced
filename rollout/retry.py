"""Retry with exponential backoff and full jitter: the one rule every rallyrl client retries by
(the SGLang HTTP client, the judge).

    backoff = Backoff(base_s=0.25, max_s=8.0)
    body = await call_with_retries(lambda: post(...), retries=5, backoff=backoff, retry_on=(RetryableError,))

Full jitter (AWS's "exponential backoff and jitter"): the wait before retry ``n`` (0 for the
first) is uniform in [0, min(max_s, base_s * 2**n)], so clients that failed together do not
retry together.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses a later attempt may not meet (timeout, too many requests, server errors)."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter."""

    base_s: float
    """Cap of the first wait; it doubles with each retry."""
    max_s: float
    """Cap of any wait."""

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry ``retry`` (0 for the first): uniform in [0, min(max_s, base_s * 2**retry)]."""
        return random.uniform(0, min(self.max_s, self.base_s * 2**retry))


async def call_with_retries(
    attempt: Callable[[], Awaitable[T]],
    *,
    retries: int,
    backoff: Backoff,
    retry_on: tuple[type[BaseException], ...],
    on_retry: Callable[[BaseException], None] | None = None,
    first_retry: int = 0,
) -> T:
    """``await attempt()`` until it returns. An exception of ``retry_on`` is retried, after
    ``backoff.delay(n)``, up to ``retries`` times (``on_retry`` sees each one), and the last one is
    raised; any other exception is raised at once. ``first_retry`` numbers the first retry here
    (for a caller that made the first attempts itself)."""
    for retry in range(first_retry, first_retry + retries + 1):
        try:
            return await attempt()
        except retry_on as exc:
            if retry == first_retry + retries:
                raise
            if on_retry is not None:
                on_retry(exc)
        await asyncio.sleep(backoff.delay(retry))
    raise AssertionError("unreachable")
