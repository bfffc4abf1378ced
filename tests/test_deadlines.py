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
    rng = random.Random(0)
    plan = [(rng.uniform(0.0, 0.2), rng.choice([0.05, 0.1, 10.0])) for _ in range(3000)]

    async def one(sleep_s: float, timeout_s: float) -> bool:
        try:
            await within(sleeps(sleep_s), timeout_s)
            return False
        except TimeoutError:
            return True

    async def main():
        timed_out = await asyncio.gather(*(one(s, t) for s, t in plan))
        assert len(deadlines(asyncio.get_running_loop())) == 0
        return timed_out

    timed_out = asyncio.run(main())
    for (sleep_s, timeout_s), out in zip(plan, timed_out, strict=True):
        if sleep_s < timeout_s - 0.03:
            assert not out, (sleep_s, timeout_s)
        elif sleep_s > timeout_s + 0.03:
            assert out, (sleep_s, timeout_s)
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
