"""A weight push: the trainer's weights into servers, in memory, in buckets, every wait with a
deadline.

The trainer hands a ``WeightSource`` (``trainer/weight_source.py``); each server that takes weights
in memory has a ``Receiver`` (``sglang_weights.py`` for SGLang and ``rallyrl serve``,
``vllm_weights.py`` for vLLM). ``push_buckets`` cuts the source into buckets once per (dtype,
device, form) the receivers want and hands each bucket to every receiver side by side:

    begin (each server)  ->  bucket 1, 2, ... (each server; the next bucket fills meanwhile)  ->  end (each server)

A receiver that fails or misses its deadline drops out with an error naming the server and the step
(``begin``, the bucket, ``end``; the fill of a bucket, which has the same deadline); the others go
on. Collectives are issued on daemon threads (``weight_collectives.py``), never the event loop's. A
bucket goes flat (one ``uint8`` tensor: NCCL, CUDA IPC) or as its tensors themselves (gloo). Flat,
the trainer holds two buckets at most: the one on the way and the next, filled in a thread while the
first travels; as tensors, none (each is sent from the trainer's own memory, converted where the
server's dtype differs). The caller (the pool, ``rollout/engines/pool.py``) pauses the servers
first, reads back each server's version after, lets the ones that took everything continue and
leaves the others paused (half their new weights must never serve) until a full push succeeds.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import torch

from rollout.engines import weight_collectives
from rollout.engines.base import EngineError, WeightSource
from rollout.engines.daemon_threads import DaemonThreads, run_once, start_once
from rollout.engines.weight_buckets import Bucket, fill_bucket, plan_buckets, target_specs

logger = logging.getLogger(__name__)


class Receiver(abc.ABC):
    """One server's end of an in-memory transport. ``begin`` -> ``send`` per bucket -> ``end``; after a
    failure ``abandon`` (the next ``begin`` starts afresh: a new group, a new session)."""

    transport: str = ""
    """"broadcast" or "tensor"."""
    flat: bool = True
    """Whether it takes each bucket as one flat ``uint8`` tensor (filled by the trainer) or as the bucket's
    tensors themselves (``Tensors``: sent from the trainer's own memory, converted only where the
    dtype differs; a broadcast over gloo on a CPU, where the copy into a flat bucket costs more than
    the collectives it saves)."""

    def __init__(self, url: str, dtype: torch.dtype, device: torch.device, timeout_s: float):
        self.url = url
        self.dtype = dtype
        """The dtype the server's weights have: floating tensors are converted to it on the trainer's side."""
        self.device = device
        """Where buckets must be for this transport (the CPU for gloo and by-value tensors)."""
        self.timeout_s = timeout_s

    def describe(self) -> str:
        """What moves the weights, for the line the trainer prints once: "broadcast (gloo)"."""
        return self.transport

    @abc.abstractmethod
    async def begin(self, version: int, buckets: Sequence[Bucket]) -> None:
        """Get ready for ``buckets`` of ``version`` (join the group on the first push, open the update)."""

    @abc.abstractmethod
    async def send(self, bucket: Bucket, payload: torch.Tensor | Tensors, count: int, version: int) -> None:
        """Hand over one bucket (``payload``: its bytes, or its tensors when not ``flat``); the last one
        names ``version``."""

    @abc.abstractmethod
    async def end(self, version: int) -> None:
        """Close the update; the server now serves ``version`` (the caller reads it back)."""

    async def abandon(self) -> None:  # noqa: B027  (a default that does nothing, not an abstract method)
        """Forget the state a failed push left (a group, an open update), quietly; nothing by default."""

    async def close(self) -> None:
        """Release what ``begin`` made (at the end of the run); ``abandon`` by default."""
        await self.abandon()


async def push_buckets(receivers: Sequence[Receiver], source: WeightSource, version: int, bucket_bytes: int,
                       timeout_s: float) -> dict[Receiver, str]:  # fmt: skip
    """Every receiver gets every bucket of ``source`` as ``version``; returns the receivers that failed,
    each with an error naming its server and the step (the others have the whole of ``version``).
    Every wait is under ``timeout_s``: each receiver's step, and the fill of each bucket (a fill that
    fails or hangs fails the receivers still waiting for that bucket, never the caller)."""
    failed: dict[Receiver, str] = {}
    specs = source.specs()
    groups: dict[tuple[torch.dtype, str, bool], list[Receiver]] = {}
    for receiver in receivers:
        groups.setdefault((receiver.dtype, str(receiver.device), receiver.flat), []).append(receiver)
    for (dtype, _, flat), group in groups.items():
        plan = plan_buckets(target_specs(specs, dtype), bucket_bytes)
        alive = await _each(group, lambda r, plan=plan: r.begin(version, plan), "begin", timeout_s, failed)
        fills = DaemonThreads(1, "rallyrl-bucket-fill")
        device = group[0].device
        payloads: AsyncIterator[tuple[Bucket, torch.Tensor | Tensors]] = (
            filled_buckets(plan, device, source.tensor, fills) if flat else bucket_tensors(plan, device, source.tensor)
        )
        try:
            async with contextlib.aclosing(payloads):  # (a bucket still filling is let go when every receiver failed)
                for index in range(len(plan)):
                    if not alive:
                        break
                    try:
                        async with asyncio.timeout(timeout_s):
                            bucket, payload = await anext(payloads)
                    except Exception as exc:  # (TimeoutError included) an OOM, a tensor the trainer cannot read
                        reason = f"no bucket within {timeout_s:g} s" if isinstance(exc, TimeoutError) else str(exc)
                        _fail(alive, f"filling {plan[index].describe(len(plan))}", reason, failed)
                        alive = []
                        break
                    where = bucket.describe(len(plan))
                    alive = await _each(alive, lambda r: r.send(bucket, payload, len(plan), version), where,  # noqa: B023
                                        timeout_s, failed)  # fmt: skip
        finally:
            fills.shutdown()
        await _each(alive, lambda r: r.end(version), "end", timeout_s, failed)
    for receiver in failed:
        with contextlib.suppress(Exception):  # (best effort, each step of it under a deadline of its own)
            await receiver.abandon()
    return failed


def _fail(receivers: Sequence[Receiver], what: str, reason: str, failed: dict[Receiver, str]) -> None:
    for receiver in receivers:
        failed[receiver] = f"{receiver.url}: weight sync ({receiver.describe()}), {what}: {reason}"
        logger.warning("%s", failed[receiver])


async def _each(receivers: Sequence[Receiver], call: Callable[[Receiver], Awaitable[None]], what: str,
                timeout_s: float, failed: dict[Receiver, str]) -> list[Receiver]:  # fmt: skip
    """``call`` on every receiver side by side, each within ``timeout_s``; the ones that succeeded."""

    async def one(receiver: Receiver) -> None:
        async with asyncio.timeout(timeout_s):
            await call(receiver)

    results = await asyncio.gather(*(one(r) for r in receivers), return_exceptions=True)
    alive = []
    for receiver, result in zip(receivers, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):  # cancelled, interrupted: not a server's failure
                raise result
            reason = f"no answer within {timeout_s:g} s" if isinstance(result, TimeoutError) else str(result)
            _fail([receiver], what, reason, failed)
        else:
            alive.append(receiver)
    return alive


async def filled_buckets(
    plan: Sequence[Bucket], device: torch.device, tensor: Callable[[str], torch.Tensor], threads: DaemonThreads
) -> AsyncIterator[tuple[Bucket, torch.Tensor]]:
    """Each bucket of ``plan`` filled (on ``threads``) into one of two buffers on ``device``: the next
    fills while the caller sends the one it was given."""
    if not plan:
        return
    largest = max(bucket.nbytes for bucket in plan)
    pin = device.type == "cpu" and torch.cuda.is_available()
    buffers = [torch.empty(largest, dtype=torch.uint8, device=device, pin_memory=pin)
               for _ in range(min(2, len(plan)))]  # fmt: skip

    def fill(index: int) -> torch.Tensor:
        flat = fill_bucket(buffers[index % len(buffers)], plan[index], tensor)
        weight_collectives.active.bucket_ready(device)  # the bytes there before another process reads them
        return flat

    filling: asyncio.Future[torch.Tensor] = asyncio.ensure_future(threads.run(fill, 0))
    try:
        for index, bucket in enumerate(plan):
            flat = await filling
            if index + 1 < len(plan):
                filling = asyncio.ensure_future(threads.run(fill, index + 1))
            yield bucket, flat
    finally:
        if not filling.done():
            filling.cancel()
            await asyncio.gather(filling, return_exceptions=True)


class Tensors(list):  # type: ignore[type-arg]
    """A bucket's tensors themselves, named, in the bucket's order and dtype (a payload that is not flat)."""


async def bucket_tensors(
    plan: Sequence[Bucket], device: torch.device, tensor: Callable[[str], torch.Tensor]
) -> AsyncIterator[tuple[Bucket, Tensors]]:
    """Each bucket of ``plan`` as its tensors, each in the bucket's dtype, contiguous, on ``device``: the
    trainer's own memory where it already is (nothing copied), a converted copy where not."""
    for bucket in plan:
        tensors = ((spec.name, tensor(spec.name).to(device=device, dtype=spec.dtype)) for spec in bucket.specs)
        yield bucket, Tensors((name, value.contiguous()) for name, value in tensors)


async def open_group(url: str, backend: str, master_address: str | None, server_ranks: int, timeout_s: float,
                     join: Callable[[str, int, str], Awaitable[Any]], leave: Callable[[str], Awaitable[Any]],
                     threads: DaemonThreads) -> tuple[Any, str]:  # fmt: skip
    """Make a weight group with the server at ``url``: the trainer opens it as rank 0 (on ``threads``:
    the rendezvous waits for every rank), its store listening on ``master_address`` alone, while
    ``join(address, port, name)`` has the server's ``server_ranks`` ranks join; either failing ends
    the wait. Returns the group and its name. On a failure or a cancel, both sides are left:
    ``leave(name)`` on the server (best effort), and the trainer's side once its rendezvous ends."""
    import uuid

    from yarl import URL

    from rollout.engines.weight_group import address_towards, bind_store

    address = master_address or address_towards(URL(url).host or "127.0.0.1")
    listen = bind_store(address)
    port = listen.getsockname()[1]
    name = f"rallyrl-{uuid.uuid4().hex[:12]}"
    mine = asyncio.ensure_future(threads.run(
        weight_collectives.active.open_group, backend, address, listen, 1 + server_ranks, name, timeout_s))  # fmt: skip
    theirs = asyncio.ensure_future(join(address, port, name))
    try:
        done, _ = await asyncio.wait({mine, theirs}, return_when=asyncio.FIRST_EXCEPTION)
        if theirs in done and theirs.exception() is not None:  # (the rendezvous gives up at its own deadline)
            raise EngineError(f"joining a weight group: {theirs.exception()}")
        if mine in done and mine.exception() is not None:
            raise EngineError(f"opening a weight group on {address}:{port}: {mine.exception()}")
        group, _ = await asyncio.gather(mine, theirs)
    except BaseException:
        listen.close()  # (a no-op once the store took it)
        theirs.cancel()
        mine.add_done_callback(_destroy_when_made)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(QUICK_S):
                await leave(name)
        raise
    return group, name


QUICK_S = 5.0
"""Deadline of leaving a group after a failure (a server that failed may not answer at all)."""


async def destroy_group(group: Any) -> None:
    """Destroy the trainer's side of ``group`` on a thread of its own, within ``QUICK_S`` (an NCCL abort
    may wait on its peers); quiet."""
    with contextlib.suppress(TimeoutError, RuntimeError):
        async with asyncio.timeout(QUICK_S):
            await run_once("rallyrl-weight-group-destroy", weight_collectives.active.destroy, group)


def _destroy_when_made(opening: asyncio.Future[Any]) -> None:
    """(A done callback) destroy a group whose opening was given up, on a thread of its own."""
    if not opening.cancelled() and opening.exception() is None:
        start_once("rallyrl-weight-group-destroy", weight_collectives.active.destroy, opening.result())


class CollectiveError(EngineError):
    """A collective failed (a peer gone, the group's own deadline passed)."""


async def collective_done(work: Any, watch: asyncio.Future[Any] | None = None) -> None:
    """Wait until a collective (``async_op=True``) is done without holding the event loop (it is polled);
    ``watch`` (the HTTP call the collective goes with) failing first raises its error at once; the
    collective's own failure is a CollectiveError. The caller bounds the wait (``asyncio.timeout``)."""
    delay = 0.0005
    while not work.is_completed():
        if watch is not None and watch.done() and not watch.cancelled() and watch.exception() is not None:
            raise watch.exception()  # type: ignore[misc]
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)
    try:
        work.wait()
    except RuntimeError as exc:
        raise CollectiveError(str(exc)) from None


async def side_by_side(call: asyncio.Future[Any], issue: Awaitable[Any], where: str,
                       wait_for_call: bool = True) -> Any:  # fmt: skip
    """Wait for an HTTP ``call`` and the collective it goes with, which need each other: ``issue``
    issues the collective (off the event loop: a first NCCL collective returns only once the server
    has joined it, which it does once the call has reached it) and gives what ``collective_done``
    polls. The collective's failure, or the call's, ends the wait at once (the other is left to its
    own deadline). Returns the call's answer (``wait_for_call`` False: returns once the collective is
    done, the call going on). The caller bounds the whole wait (``asyncio.timeout``)."""
    issuing = asyncio.ensure_future(issue)
    try:
        while not issuing.done():
            await asyncio.wait({issuing, call}, return_when=asyncio.FIRST_COMPLETED)
            if call.done() and not call.cancelled() and call.exception() is not None:
                raise call.exception()  # type: ignore[misc]
        try:
            work = issuing.result()
        except RuntimeError as exc:  # (the group is broken)
            raise EngineError(f"{where}: issuing the collective failed: {exc}") from None
        try:
            await collective_done(work, call)
        except CollectiveError as exc:
            raise EngineError(f"{where}: the collective failed: {exc}") from None
        return await call if wait_for_call else None
    except BaseException:
        issuing.cancel()  # (a collective still being issued stays on its thread until its group is destroyed)
        if not call.done():
            call.cancel()
        raise
