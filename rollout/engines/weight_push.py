"""A weight push: the trainer's weights into servers, in memory, in buckets, every wait with a deadline.

The trainer hands a ``WeightSource`` (``trainer/weight_source.py``); each server that takes weights in
memory has a ``Receiver`` (``sglang_weights.py`` for SGLang and ``rallyrl serve``, ``vllm_weights.py``
for vLLM). ``push_buckets`` cuts the source into buckets once per (dtype, device, form) the receivers
want and hands each bucket to every receiver side by side:

    begin (each server)  ->  bucket 1, 2, ... (each server; the next bucket fills meanwhile)  ->  end (each server)

A receiver that fails or misses its deadline drops out with an error naming the server and the step
(``begin``, the bucket, ``end``); the others go on. A bucket goes flat (one ``uint8`` tensor: NCCL,
CUDA IPC) or as its tensors themselves (gloo). Flat, the trainer holds two buckets at most: the one on
the way and the next, filled in a thread while the first travels; as tensors, none (each is sent
from the trainer's own memory, converted where the server's dtype differs). The caller (the pool,
``rollout/engines/pool.py``) pauses the servers first, reads back each server's version after, lets
the ones that took everything continue and leaves the others paused (half their new weights must
never serve) until a full push succeeds.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from rollout.engines.base import EngineError, WeightSource
from rollout.engines.weight_buckets import Bucket, WeightSpec, fill_bucket, plan_buckets

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


def target_specs(specs: Sequence[WeightSpec], dtype: torch.dtype) -> list[WeightSpec]:
    """``specs`` as a server of ``dtype`` takes them: floating tensors in its dtype, others as they are."""
    return [replace(spec, dtype=dtype) if spec.dtype.is_floating_point else spec for spec in specs]


async def push_buckets(receivers: Sequence[Receiver], source: WeightSource, version: int, bucket_bytes: int,
                       timeout_s: float) -> dict[Receiver, str]:  # fmt: skip
    """Every receiver gets every bucket of ``source`` as ``version``; returns the receivers that failed,
    each with an error naming its server and the step (the others have the whole of ``version``)."""
    failed: dict[Receiver, str] = {}
    specs = source.specs()
    groups: dict[tuple[torch.dtype, str, bool], list[Receiver]] = {}
    for receiver in receivers:
        groups.setdefault((receiver.dtype, str(receiver.device), receiver.flat), []).append(receiver)
    for (dtype, _, flat), group in groups.items():
        plan = plan_buckets(target_specs(specs, dtype), bucket_bytes)
        alive = await _each(group, lambda r, plan=plan: r.begin(version, plan), "begin", timeout_s, failed)
        payloads = (filled_buckets if flat else bucket_tensors)(plan, group[0].device, source.tensor)
        async with contextlib.aclosing(payloads):  # (a bucket still filling is let go when every receiver failed)
            async for bucket, payload in payloads:
                if not alive:
                    break
                where = bucket.describe(len(plan))
                alive = await _each(alive, lambda r: r.send(bucket, payload, len(plan), version), where, timeout_s,  # noqa: B023
                                    failed)  # fmt: skip
        await _each(alive, lambda r: r.end(version), "end", timeout_s, failed)
    for receiver in failed:
        await receiver.abandon()
    return failed


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
            failed[receiver] = f"{receiver.url}: weight sync ({receiver.describe()}), {what}: {reason}"
            logger.warning("%s", failed[receiver])
        else:
            alive.append(receiver)
    return alive


async def filled_buckets(
    plan: Sequence[Bucket], device: torch.device, tensor: Callable[[str], torch.Tensor]
) -> AsyncIterator[tuple[Bucket, torch.Tensor]]:
    """Each bucket of ``plan`` filled (in a worker thread) into one of two buffers on ``device``: the
    next fills while the caller sends the one it was given."""
    if not plan:
        return
    largest = max(bucket.nbytes for bucket in plan)
    pin = device.type == "cpu" and torch.cuda.is_available()
    buffers = [torch.empty(largest, dtype=torch.uint8, device=device, pin_memory=pin)
               for _ in range(min(2, len(plan)))]  # fmt: skip

    def fill(index: int) -> torch.Tensor:
        flat = fill_bucket(buffers[index % len(buffers)], plan[index], tensor)
        if device.type == "cuda":  # the bytes must be there before another process or stream reads them
            torch.cuda.synchronize(device)
        return flat

    filling: asyncio.Task[torch.Tensor] = asyncio.ensure_future(asyncio.to_thread(fill, 0))
    try:
        for index, bucket in enumerate(plan):
            flat = await filling
            if index + 1 < len(plan):
                filling = asyncio.ensure_future(asyncio.to_thread(fill, index + 1))
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


class AllDone:
    """Several collectives (``async_op=True``) waited on as one: done when every one is."""

    def __init__(self, works: list[Any]):
        self.works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def broadcast(payload: torch.Tensor | Tensors, group: Any) -> Any:
    """Broadcast a flat bucket, or a bucket's tensors one by one, from rank 0 of ``group`` (``async_op``)."""
    import torch.distributed as dist

    if isinstance(payload, torch.Tensor):
        return dist.broadcast(payload, src=0, group=group, async_op=True)
    return AllDone([dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in payload])


async def open_group(url: str, backend: str, master_address: str | None, server_ranks: int, timeout_s: float,
                     join: Callable[[str, int, str], Awaitable[Any]]) -> tuple[Any, str]:  # fmt: skip
    """Make a weight group with the server at ``url``: the trainer opens it as rank 0 (in a thread: the
    rendezvous waits for every rank) while ``join(address, port, name)`` has the server's
    ``server_ranks`` ranks join; either failing ends the wait. Returns the group and its name."""
    import uuid

    from yarl import URL

    from rollout.engines.weight_group import address_towards, destroy_weight_group, free_port, init_weight_group

    address = master_address or address_towards(URL(url).host or "127.0.0.1")
    port = free_port(address)
    name = f"rallyrl-{uuid.uuid4().hex[:12]}"
    mine = asyncio.ensure_future(asyncio.to_thread(
        init_weight_group, backend, address, port, 1 + server_ranks, 0, name, timeout_s))  # fmt: skip
    theirs = asyncio.ensure_future(join(address, port, name))
    done, _ = await asyncio.wait({mine, theirs}, return_when=asyncio.FIRST_EXCEPTION)
    if theirs in done and theirs.exception() is not None:  # (the rendezvous gives up at its own deadline)
        mine.add_done_callback(lambda task: task.exception() or destroy_weight_group(task.result()))
        raise EngineError(f"joining a weight group: {theirs.exception()}")
    if mine in done and mine.exception() is not None:
        theirs.cancel()
        raise EngineError(f"opening a weight group on {address}:{port}: {mine.exception()}")
    group, _ = await asyncio.gather(mine, theirs)
    return group, name


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


async def side_by_side(call: asyncio.Future[Any], work: Any, where: str, wait_for_call: bool = True) -> Any:
    """Wait for an HTTP ``call`` and a collective ``work`` (``async_op=True``) that need each other: the
    collective's failure, or the call's, ends the wait at once (the other is left to its own deadline).
    Returns the call's answer (``wait_for_call`` False: returns once the collective is done, the call
    going on). The caller bounds the whole wait (``asyncio.timeout``)."""
    try:
        try:
            await collective_done(work, call)
        except CollectiveError as exc:
            raise EngineError(f"{where}: the collective failed: {exc}") from None
        return await call if wait_for_call else None
    except BaseException:
        if not call.done():
            call.cancel()
        raise
