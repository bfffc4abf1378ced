"""``rollout.deadlines.within``: the same outcomes as ``asyncio.timeout`` (results, TimeoutError,
cancellation from outside, a coroutine that swallows the cancellation), one timer per event loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollout.deadlines import deadlines, within


async def with_asyncio_timeout(coroutine, timeout_s: float):
    async with asyncio.timeout(timeout_s):
        return await coroutine


async def sleeps(seconds: float, result: str = "done", log: list[str] | None = None) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if log is not None:
            log.append("cancelled")
        raise
    return result


async def swallows(seconds: float) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        return "swallowed"
    return "done"


async def at_once() -> str:
    return "now"


async def raises() -> str:
    await asyncio.sleep(0)
    raise ValueError("boom")


def outcome(run) -> str:
    async def main():
        try:
            return f"returned {await run()}"
        except TimeoutError:
            return "TimeoutError"
        except asyncio.CancelledError:
            return "CancelledError"
        except ValueError as exc:
            return f"ValueError {exc}"

    return asyncio.run(main())


CASES = {
    "finishes in time": lambda timed: timed(sleeps(0.01), 1.0),
    "times out": lambda timed: timed(sleeps(1.0), 0.02),
    "finishes without waiting": lambda timed: timed(at_once(), 0.02),
    "raises": lambda timed: timed(raises(), 1.0),
    "swallows the cancellation": lambda timed: timed(swallows(1.0), 0.02),
    "zero timeout": lambda timed: timed(sleeps(0.05), 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_the_same_outcome_as_asyncio_timeout(case):
    assert outcome(lambda: CASES[case](within)) == outcome(lambda: CASES[case](with_asyncio_timeout))


def test_a_timeout_cancels_the_coroutine_and_raises_timeout_error():
    log: list[str] = []

    async def main():
        with pytest.raises(TimeoutError):
            await within(sleeps(10.0, log=log), 0.02)
        assert asyncio.current_task().cancelling() == 0  # the cancellation was taken back
        assert len(deadlines(asyncio.get_running_loop())) == 0

    asyncio.run(main())
    assert log == ["cancelled"]


def test_a_cancellation_from_outside_passes_through_as_cancellation():
    async def main():
        task = asyncio.create_task(within(sleeps(10.0), 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(deadlines(asyncio.get_running_loop())) == 0

    asyncio.run(main())


def test_a_coroutine_that_does_not_wait_gets_no_deadline():
    async def now() -> int:
        return 7

    async def main():
        assert await within(now(), 1.0) == 7
        assert len(deadlines(asyncio.get_running_loop())) == 0

    asyncio.run(main())


def test_thousands_of_deadlines_each_fire_on_time_or_not_at_all():
    """Each of 3,000 concurrent deadlines fires no earlier than it is due, and not at all for a
    coroutine that finished well before it. "Well before" allows for the event loop's own lag, read
    off a ticker running beside them: on a loaded machine a sleep that ends at 20 ms may be resumed
    after a deadline due at 50 ms, with ``asyncio.timeout`` exactly as with ``within``."""
    rng = random.Random(0)
    plan = [(rng.uniform(0.0, 0.2), rng.choice([0.05, 0.1, 10.0])) for _ in range(3000)]
    early: list[float] = []

    async def one(sleep_s: float, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await within(sleeps(sleep_s), timeout_s)
            return False
        except TimeoutError:
            early.append(started + timeout_s - loop.time())
            return True

    async def ticker(lags: list[float], stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            due = loop.time() + 0.002
            await asyncio.sleep(0.002)
            lags.append(loop.time() - due)

    async def main():
        lags: list[float] = [0.0]
        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(lags, stop))
        timed_out = await asyncio.gather(*(one(s, t) for s, t in plan))
        stop.set()
        await ticking
        assert len(deadlines(asyncio.get_running_loop())) == 0
        return timed_out, max(lags)

    timed_out, lag = asyncio.run(main())
    assert max(early) <= 0.001  # never before it is due (the loop runs timers up to its clock resolution early)
    margin = 0.03 + lag
    for (sleep_s, timeout_s), out in zip(plan, timed_out, strict=True):
        if timeout_s == 10.0 or sleep_s < timeout_s - margin:
            assert not out, (sleep_s, timeout_s, lag)
        elif sleep_s > timeout_s + margin:  # (a loop stalled past both makes either order right)
            assert out, (sleep_s, timeout_s, lag)
    assert sum(timed_out) > 500


def test_nested_deadlines_each_raise_where_they_belong():
    async def inner() -> str:
        try:
            return await within(sleeps(10.0), 0.02)
        except TimeoutError:
            return "inner timed out"

    async def main():
        assert await within(inner(), 5.0) == "inner timed out"
        with pytest.raises(TimeoutError):
            await within(within(sleeps(10.0), 5.0), 0.02)

    asyncio.run(main())


async def in_timeout_after(coroutine, timeout_s: float):
    from rollout.deadlines import timeout_after

    with timeout_after(timeout_s):
        return await coroutine


@pytest.mark.parametrize("case", CASES)
def test_timeout_after_around_a_block_is_asyncio_timeout_too(case):
    assert outcome(lambda: CASES[case](in_timeout_after)) == outcome(lambda: CASES[case](with_asyncio_timeout))
