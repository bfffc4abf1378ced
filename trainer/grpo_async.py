"""Asynchronous GRPO's trainer side (``GRPOConfig.async_rl``): the loop of ``GRPOTrainer.train``
when rollouts never stop. Read ``async_step`` top to bottom: take finished groups (dropping and
regenerating those too stale to train), update on them in a worker thread while the event loop
keeps the requests moving, sync the engine, reopen their slots on the new weights. The rollout
side (the producer, the prompt ledger) is ``trainer/async_rl.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

from rollout.request import AsyncRolloutRequest
from trainer.async_rl import Group, GroupProducer, PromptLedger
from trainer.distributed import sum_across_processes
from trainer.groups import select_groups
from trainer.metrics_log import PhaseTimer
from trainer.preemption import Abandoned


async def train_async(trainer: Any, finished: Any) -> None:
    """Steps on groups a background producer keeps rolling out (``trainer/async_rl.py``)."""
    config, accelerator = trainer.config, trainer.accelerator
    rank, world = accelerator.process_index, accelerator.num_processes
    share = len(range(rank, config.prompts_per_step, world))
    streams = trainer.state.streams
    if streams is not None and len(streams) != world:
        raise ValueError(f"--resume: the checkpoint was written by {len(streams)} processes, this run has {world}")
    ledger = PromptLedger(trainer.prompts.records, rank, world, streams[rank] if streams else None)
    if streams is None and trainer.state.data_position:  # a synchronous run's checkpoint
        ledger.mark = ledger.cursor = max(0, -(-(trainer.state.data_position - rank) // world))
    trainer.ledger = ledger

    def no_signal(group: Group) -> bool:  # filtered out, or every request failed
        return not select_groups(group.requests, config.filter_groups, 1)[0]

    producer = GroupProducer(
        trainer.metered, trainer.chat, trainer.tools, config.rollout, trainer.reward_fn, ledger,
        config.samples_per_prompt,
        capacity=(config.max_staleness + 1) * share, seed=config.seed, version=trainer.state.step, discard=no_signal,
        interactions=trainer.interactions, agent=trainer.agent,
    )  # fmt: skip
    async with producer:  # (on its way out: what is in flight is cancelled, rolled out again after --resume)
        with contextlib.suppress(Abandoned):  # a signal: the step stops taking groups, and consumes none
            while not await trainer.preemption.stopping() and trainer.state.step < config.steps:
                if finished(await async_step(trainer, producer, share)):
                    await asyncio.to_thread(trainer.save_checkpoint)  # requests go on meanwhile


async def async_step(trainer: Any, producer: GroupProducer, share: int) -> dict[str, Any]:
    """Take finished groups until ``share`` have signal (or ``max_draws`` is reached), update on
    them in a worker thread while rollouts go on, then sync the engine. The groups taken are
    consumed (in the ledger) once the step goes on to its update: a signal before that abandons it."""
    config, ledger, preemption = trainer.config, trainer.ledger, trainer.preemption
    version = trainer.state.step
    timer = PhaseTimer()
    cap = max(share, math.floor(share * config.max_draws)) if config.filter_groups else share
    taken: list[AsyncRolloutRequest] = []
    positions: list[int] = []  # of the groups taken
    kept: list[AsyncRolloutRequest] = []
    trained = draws = dropped = 0
    stats = dict(select_groups([], config.filter_groups, 1)[1])  # every key, so that processes sum alike
    with timer("wait"):
        while trained < share and draws < cap:
            group, discarded = await preemption.abandonable("wait", producer.next_finished())
            if not discarded and group.staleness(version) > config.max_staleness:  # too late: regenerate
                ledger.regenerate(group.position, group.attempt)
                dropped += 1
                await producer.release()
                continue
            positions.append(group.position)
            draws += 1
            taken += group.requests
            usable, counts = select_groups(group.requests, config.filter_groups, 1)
            for key, value in counts.items():
                stats[key] = stats.get(key, 0) + value
            if usable:
                kept += usable
                trained += 1
            elif not discarded:  # (a producer without ``discard``) its slot reopens now
                await producer.release()
    await preemption.check()  # a signal (to any process): Abandoned, the groups taken not consumed
    for position in positions:
        ledger.consume(position)
    stats.update(prompts_drawn=draws, draw_cap_hit=float(trained < share), dropped=dropped,
                 queued_groups=producer.queued())  # fmt: skip
    await preemption.pause("update")  # (tests only: RALLYRL_TEST_PAUSE_AT)
    with timer("update"):
        async with trainer.weights.changing():  # (a server brought back meanwhile waits for the sync)
            rollout, stats, update = await asyncio.to_thread(async_update, trainer, taken, kept, stats, version)
    await preemption.pause("sync")
    with timer("sync"):
        await trainer.sync(trainer.engine, version + 1)
    trainer.state.step += 1
    producer.version = trainer.state.step
    await producer.release(trained)  # their slots reopen on the new weights
    stats["draw_cap_hit"] = float(stats["draw_cap_hit"] > 0)
    return trainer.step_metrics(rollout, stats, update, timer)


def async_update(trainer: Any, taken: list[AsyncRolloutRequest], kept: list[AsyncRolloutRequest],
                 stats: dict[str, float], version: int) -> tuple[dict, dict, dict]:  # fmt: skip
    """The collective part of an async step (run in a worker thread): counts over processes,
    the update, the rollout statistics of the groups taken."""
    stats = sum_across_processes(trainer.accelerator, stats)
    update = trainer.update(trainer.samples_of(kept))
    rollout = trainer.rollout_metrics(taken, policy_version=version)
    trained = trainer.rollout_metrics(kept, policy_version=version)  # staleness: of the trained tokens
    rollout.update(staleness_mean=trained["staleness_mean"], staleness_max=trained["staleness_max"])
    return rollout, stats, update
