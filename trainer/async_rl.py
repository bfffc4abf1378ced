"""Asynchronous GRPO's rollout side: groups roll out continuously into a queue; the trainer
takes them as they finish.

- ``PromptLedger``: this process's prompts, in a fixed order (global positions ``rank``,
  ``rank + world``, ...), with an exact record of which were consumed (trained on, or filtered
  out), so that a resumed run neither loses a prompt nor counts one twice. Prompts that were in
  flight or queued at a checkpoint are regenerated after ``--resume``.
- ``GroupProducer``: the background task. It starts a group (``samples_per_prompt`` requests of
  one prompt) whenever fewer than ``(max_staleness + 1) x share`` groups are in the system
  (started, and not yet trained or discarded). A slot frees only when its group is filtered
  out (at once, as it finishes: a group without signal never waits for the trainer), dropped,
  or trained *and* the new weights are on the engine, so a group started at policy version v
  is, finishing in order, trained by step v + max_staleness. A group that finishes out of order
  so late that its oldest token is too stale is dropped and its prompt regenerated
  (``Group.staleness`` against the version being trained).
- ``MeteredEngine``: the engine as the rollout sees it, counting the seconds when no
  generation is in flight (the engine idle fraction of the metrics).

The trainer loop (``train_async`` in ``trainer/grpo_async.py``) collects groups, updates
in a worker thread while this event loop keeps the requests moving, then syncs the weights;
requests in flight at the sync continue from their tokens on the new weights (the engines
resume them) and each token keeps the version that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data.reward_fns import RewardFn
from data.schema import Record
from rollout.config import RolloutConfig
from rollout.engines.base import Engine, Generation, SamplingParams
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest
from rollout.runner import request_from_record
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool

if TYPE_CHECKING:
    from rollout.gateway.agents import AgentDriver


class MeteredEngine:
    """``engine`` for the rollout loop (``generate`` only), timing when nothing is generating."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.in_flight = 0
        self._idle_total = 0.0
        self._idle_since: float | None = time.monotonic()

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        if self.in_flight == 0 and self._idle_since is not None:
            self._idle_total += time.monotonic() - self._idle_since
            self._idle_since = None
        self.in_flight += 1
        try:
            return await self.engine.generate(input_ids, sampling, rid)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle_since = time.monotonic()

    def idle_seconds(self) -> float:
        """Seconds so far with no generation in flight."""
        if self._idle_since is None:
            return self._idle_total
        return self._idle_total + time.monotonic() - self._idle_since

    def __getattr__(self, name: str) -> Any:  # abort, update_weights, health: the engine's own
        return getattr(self.engine, name)


@dataclass
class Group:
    """The ``samples_per_prompt`` requests of one prompt, started together."""

    position: int
    """The prompt's place in the global stream; its requests' ``prompt_index``."""
    record: Record
    attempt: int
    """0, or how many times this prompt was regenerated (it samples with another seed each time)."""
    requests: list[AsyncRolloutRequest] = field(default_factory=list)

    def oldest_version(self) -> int | None:
        """The oldest weight version of any generated token (None: no token generated)."""
        versions = [v for r in self.requests for v in r.weight_versions if v is not None]
        return min(versions, default=None)

    def staleness(self, policy_version: int) -> int:
        """How far its oldest token lags ``policy_version`` (0 with no token)."""
        oldest = self.oldest_version()
        return 0 if oldest is None else policy_version - oldest


class PromptLedger:
    """This process's prompts and which of them were consumed (see the module docstring)."""

    def __init__(self, records: list[Record], rank: int, world: int, state: dict[str, Any] | None = None):
        if not records:
            raise ValueError("no prompts to train on")
        self.records, self.rank, self.world = records, rank, world
        self.mark = 0  # ordinals below it are all consumed
        self.consumed: set[int] = set()  # consumed ordinals at or above ``mark``
        if state:
            self.mark = int(state["mark"])
            self.consumed = {int(k) for k in state["consumed"]}
        self.cursor = self.mark
        self.retry: deque[tuple[int, int]] = deque()  # (ordinal, attempt) to regenerate first

    def position(self, ordinal: int) -> int:
        return self.rank + self.world * ordinal

    def ordinal(self, position: int) -> int:
        return (position - self.rank) // self.world

    def record(self, ordinal: int) -> Record:
        return self.records[self.position(ordinal) % len(self.records)]

    def next(self) -> tuple[int, int]:
        """The next (ordinal, attempt) to roll out: a regeneration first, else a fresh prompt."""
        if self.retry:
            return self.retry.popleft()
        while self.cursor in self.consumed:
            self.cursor += 1
        self.cursor += 1
        return self.cursor - 1, 0

    def regenerate(self, position: int, attempt: int) -> None:
        self.retry.append((self.ordinal(position), attempt + 1))

    def consume(self, position: int) -> None:
        ordinal = self.ordinal(position)
        if ordinal < self.mark or ordinal in self.consumed:
            raise RuntimeError(f"prompt at position {position} consumed twice")
        self.consumed.add(ordinal)
        while self.mark in self.consumed:
            self.consumed.discard(self.mark)
            self.mark += 1

    def state(self) -> dict[str, Any]:
        return {"mark": self.mark, "consumed": sorted(self.consumed)}

    def lowest_unconsumed_position(self) -> int:
        return self.position(self.mark)


class GroupProducer:
    """Starts groups while the staleness bound allows; finished groups wait in ``done``."""

    def __init__(
        self,
        engine: MeteredEngine,
        chat: ChatTokenizer,
        tools: dict[str, BaseTool],
        rollout: RolloutConfig,
        reward_fn: RewardFn,
        ledger: PromptLedger,
        samples_per_prompt: int,
        capacity: int,
        seed: int,
        version: int = 0,
        discard: Callable[[Group], bool] | None = None,
        interactions: dict[str, Any] | None = None,
        agent: AgentDriver | None = None,
    ):
        self.engine, self.chat, self.tools, self.reward_fn = engine, chat, tools, reward_fn
        self.interactions = interactions
        self.agent = agent  # an agent entry point drives each request through the gateway, instead of run_request
        self.rollout, self.ledger, self.samples_per_prompt = rollout, ledger, samples_per_prompt
        self.capacity, self.seed, self.version = capacity, seed, version
        self.discard = discard
        self.done: asyncio.Queue[Group] = asyncio.Queue()
        self.discarded: list[Group] = []  # finished without signal: their slots reopened at once
        self.in_system = 0  # groups started and not yet released
        self.arrived = asyncio.Event()  # a group finished (queued or discarded)
        self._slot = asyncio.Condition()
        self._semaphore = asyncio.Semaphore(rollout.max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    async def __aenter__(self) -> GroupProducer:
        self._task = asyncio.create_task(self._run(), name="group-producer")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Cancel what is in flight: every request ends as aborted and releases its tools."""
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def next_finished(self) -> tuple[Group, bool]:
        """The next finished group and whether it was discarded (no signal), discarded ones first;
        re-raises a failure of the producer itself."""
        while True:
            if self.discarded:
                return self.discarded.pop(0), True
            if not self.done.empty():
                return self.done.get_nowait(), False
            if self.error is not None:
                raise RuntimeError(f"the rollout producer failed: {self.error!r}") from self.error
            if self._task is not None and self._task.done():  # cancelled: nothing more will come
                raise RuntimeError("the rollout producer has stopped")
            self.arrived.clear()
            arrived = asyncio.ensure_future(self.arrived.wait())
            waiter = self._task if self._task is not None else arrived
            await asyncio.wait({arrived, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not arrived.done():
                arrived.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await arrived

    async def release(self, count: int = 1) -> None:
        """``count`` groups left the system (trained with the weights synced, filtered, dropped)."""
        async with self._slot:
            self.in_system -= count
            self._slot.notify_all()

    async def _run(self) -> None:
        try:
            while True:
                async with self._slot:
                    await self._slot.wait_for(lambda: self.in_system < self.capacity)
                    self.in_system += 1
                ordinal, attempt = self.ledger.next()
                group = Group(self.ledger.position(ordinal), self.ledger.record(ordinal), attempt)
                task = asyncio.create_task(self._roll_out(group))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(0)  # let it reach the engine before the next one renders
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug: surface it in the trainer rather than hang
            self.error = exc
            raise

    async def _roll_out(self, group: Group) -> None:
        seed = self.rollout.seed if self.rollout.seed is not None else self.seed
        config = dataclasses.replace(self.rollout, seed=seed * 100_003 + 50_021 * group.attempt)
        group.requests = [
            request_from_record(group.record, group.position, i, f"g{group.position}.{group.attempt}-{i}")
            for i in range(self.samples_per_prompt)
        ]

        async def one(request: AsyncRolloutRequest) -> None:
            async with self._semaphore:
                if self.agent is not None:
                    await self.agent.run(request, config)
                else:
                    await run_request(
                        request, self.engine, self.chat, self.tools, config, self.reward_fn, self.interactions
                    )

        try:
            await asyncio.gather(*(one(r) for r in group.requests))
            if self.discard is not None and self.discard(group):  # no signal: nothing to train, free the slot now
                self.discarded.append(group)
                await self.release()
            else:
                self.done.put_nowait(group)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug (requests never raise): stop the trainer rather than hang it
            self.error = exc
        finally:
            self.arrived.set()

    def queued(self) -> int:
        return self.done.qsize()
