"""Fan-out of a batch: records x n samples as concurrent requests, streamed to JSONL as they finish.

Results come back in (prompt_index, sample_index) order whatever order they finish in.
The JSONL file holds one line per finished trajectory in finishing order, flushed as each
finishes, so an interrupted run keeps everything it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from data.reward_fns import RewardFn
from data.schema import Record
from rollout.config import RolloutConfig
from rollout.engines.base import Engine
from rollout.loop import default_reward, run_request
from rollout.open_files import ensure_open_files, sockets_for
from rollout.output_file import open_output
from rollout.request import AsyncRolloutRequest
from rollout.stats import RolloutCounts, pass_at_n
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool

if TYPE_CHECKING:
    from rollout.gateway.agents import AgentDriver


@dataclass
class RolloutSummary:
    """Aggregates of one rollout, as printed and as logged (definitions: ``rollout/stats.py``)."""

    trajectories: int = 0
    prompts: int = 0
    samples_per_prompt: int = 1
    reward_mean: float = 0.0
    reward_std: float = 0.0
    rewards_missing: int = 0
    accuracy: float | None = None
    pass_at_n: float | None = None
    turns: float = 0.0
    tool_calls: float = 0.0
    tool_errors: float = 0.0
    malformed_call_share: float = 0.0
    tool_error_share: float = 0.0
    user_turns: float | None = None  # per request with an interaction; None: no interaction
    split_sessions: int | None = None  # gateway sessions the agent's history rewrites split; None: none did
    error_rate: float = 0.0
    truncated_rate: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    generated_tokens: int = 0
    consistency_failures: int = 0
    history_rewrites: int | None = None  # declared template rewrites of earlier turns (not failures); None: none
    reasoning_tokens: float | None = None  # per request, with a reasoning parser; None: no reasoning
    truncated_in_reasoning: int | None = None  # "length" finishes whose budget ran out while reasoning
    tokens_per_s: float = 0.0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def table(self) -> Table:
        table = Table(title="rollout summary", show_header=False)
        for key, value in self.to_dict().items():
            if value is None and key in ("user_turns", "split_sessions", "history_rewrites", "reasoning_tokens",
                                         "truncated_in_reasoning"):  # (not applicable to this rollout)  # fmt: skip
                continue
            if isinstance(value, float):
                value = f"{value:.4g}"
            elif isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
            table.add_row(f"rollout/{key}", "-" if value is None else str(value))
        return table


def summarize(requests: list[AsyncRolloutRequest], wall_s: float, samples_per_prompt: int) -> RolloutSummary:
    """Rewards, accuracy, pass@n, turns, tool calls, finish reasons and throughput of a batch."""
    counts = RolloutCounts.of(requests)
    metrics = counts.metrics()
    return RolloutSummary(
        trajectories=counts.requests,
        prompts=len({r.prompt_index for r in requests}),
        samples_per_prompt=samples_per_prompt,
        reward_mean=0.0 if not counts.rewarded else metrics["reward_mean"],
        reward_std=0.0 if not counts.rewarded else metrics["reward_std"],
        rewards_missing=metrics["rewards_missing"],
        accuracy=metrics["accuracy"],
        pass_at_n=pass_at_n(requests),
        turns=metrics["turns"],
        tool_calls=metrics["tool_calls"],
        tool_errors=metrics["tool_errors"],
        malformed_call_share=metrics["malformed_call_share"],
        tool_error_share=metrics["tool_error_share"],
        user_turns=metrics.get("user_turns"),
        split_sessions=metrics.get("split_sessions"),
        error_rate=metrics["error_rate"],
        truncated_rate=metrics["truncated_rate"],
        finish_reasons=counts.finish_reasons,
        generated_tokens=counts.generated_tokens,
        consistency_failures=counts.consistency_failures,
        history_rewrites=counts.history_rewrites or None,
        reasoning_tokens=metrics.get("reasoning_tokens"),
        truncated_in_reasoning=counts.truncated_in_reasoning if counts.reasoning_tokens else None,
        tokens_per_s=counts.generated_tokens / wall_s if wall_s > 0 else 0.0,
        wall_s=wall_s,
    )


@dataclass
class RolloutResult:
    requests: list[AsyncRolloutRequest]  # in (prompt_index, sample_index) order
    summary: RolloutSummary


class RolloutRunner:
    """Runs records x n samples through ``run_request`` under a concurrency bound."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatTokenizer,
        tools: dict[str, BaseTool],
        config: RolloutConfig | None = None,
        *,
        max_concurrency: int | None = None,
        reward_fn: RewardFn = default_reward,
        progress: bool = True,
        console: Console | None = None,
        interactions: dict[str, Any] | None = None,
        agent: AgentDriver | None = None,
    ):
        self.engine, self.chat, self.tools = engine, chat, tools
        self.interactions = interactions
        self.agent = agent
        """An agent entry point driving each request through the gateway (``rollout/gateway/agents.py``), or None:
        rallyrl's own loop (``run_request``) with ``tools`` and ``interactions``."""
        self.config = config or RolloutConfig()
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.reward_fn = reward_fn
        self.progress = progress
        self.console = console or Console(stderr=True)

    async def run(
        self,
        records: list[Record],
        samples_per_prompt: int = 1,
        out_path: str | Path | None = None,
        prompt_indices: list[int] | None = None,
        skip: Collection[tuple[int, int]] = (),
        append: bool = False,
    ) -> RolloutResult:
        """Roll out every record ``samples_per_prompt`` times; stream finished trajectories to ``out_path`` (JSONL).
        ``prompt_indices`` numbers the records (default 0, 1, ...), e.g. by their place in a
        batch split over processes. ``skip`` holds (prompt_index, sample_index) pairs already
        done (a resumed run, see ``read_finished``); ``append`` adds to ``out_path``."""
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        indices = list(range(len(records))) if prompt_indices is None else prompt_indices
        if len(indices) != len(records):
            raise ValueError(f"{len(indices)} prompt indices for {len(records)} records")
        run_id = uuid.uuid4().hex[:8]
        skip = set(skip)
        total = sum((p, s) not in skip for p in indices for s in range(samples_per_prompt))
        requests = (  # built as they are started, so the first ones leave at once
            request_from_record(record, prompt_index, sample_index, f"{run_id}-{prompt_index}-{sample_index}")
            for prompt_index, record in zip(indices, records, strict=True)
            for sample_index in range(samples_per_prompt)
            if (prompt_index, sample_index) not in skip
        )
        concurrency = self.max_concurrency or self.config.max_concurrency
        ensure_open_files(sockets_for(self.engine, min(total, concurrency)))  # (before any request starts)
        semaphore = asyncio.Semaphore(concurrency)
        live = _LiveCounts()
        started = time.monotonic()
        out = open_output(out_path, append)
        progress = self._progress_bar(total)

        async def one(request: AsyncRolloutRequest) -> AsyncRolloutRequest:
            async with semaphore:
                live.running += 1
                try:
                    if self.agent is not None:
                        await self.agent.run(request, self.config)
                    else:
                        await run_request(request, self.engine, self.chat, self.tools, self.config, self.reward_fn,
                                          self.interactions)  # fmt: skip
                finally:
                    live.running -= 1
            live.finished(request)
            if out is not None:
                out.write(orjson.dumps(request.to_record()) + b"\n")
            if progress is not None:
                progress.update(task, advance=1, **live.fields(time.monotonic() - started))
            return request

        try:
            if progress is not None:
                progress.start()
                task = progress.add_task("rollout", total=total, **live.fields(0.0))
            with old_objects_frozen():
                done = await _start_in_waves(one, requests)
        finally:
            if progress is not None:
                progress.stop()
            if out is not None:
                out.close()
        return RolloutResult(list(done), summarize(list(done), time.monotonic() - started, samples_per_prompt))

    def _progress_bar(self, total: int) -> Progress | None:
        if not self.progress:
            return None
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("running {task.fields[running]}"),
            TextColumn("tool calls {task.fields[tool_calls]}"),
            TextColumn("{task.fields[tokens_per_s]:.0f} tok/s"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )


@dataclass
class _LiveCounts:
    running: int = 0
    tool_calls: int = 0
    tokens: int = 0

    def finished(self, request: AsyncRolloutRequest) -> None:
        self.tool_calls += request.metrics.tool_calls
        self.tokens += request.metrics.generated_tokens

    def fields(self, elapsed: float) -> dict[str, Any]:
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return {"running": self.running, "tool_calls": self.tool_calls, "tokens_per_s": rate}


START_WAVE = 16
"""Requests started between two turns of the event loop when a rollout begins."""


async def _start_in_waves(
    one: Callable[[AsyncRolloutRequest], Awaitable[AsyncRolloutRequest]], requests: Iterable[AsyncRolloutRequest]
) -> list[AsyncRolloutRequest]:
    """``gather`` over every request, started ``START_WAVE`` at a time with a turn of the event
    loop in between, so that the first requests reach the engine while later ones are still
    rendering their prompts (started all at once, a thousand requests would each render
    before the first one's connection is even serviced)."""
    tasks: list[asyncio.Task[AsyncRolloutRequest]] = []
    try:
        for i, request in enumerate(requests):
            tasks.append(asyncio.create_task(one(request)))
            if i % START_WAVE == START_WAVE - 1:
                await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Keep the cyclic garbage collector off the objects that existed before the rollout.

    With torch and transformers imported the heap holds millions of objects, and each full
    collection walks all of them: about a third of a rollout's client CPU went there. Frozen
    objects are still freed by reference counting; they are unfrozen at the end, so nothing
    escapes collection for longer than the rollout.
    """
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(20_000, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def request_from_record(record: Record, prompt_index: int, sample_index: int, request_id: str) -> AsyncRolloutRequest:
    """A PENDING request for one sample of ``record`` (its prompt messages copied, never shared)."""
    return AsyncRolloutRequest(
        request_id=request_id,
        prompt_index=prompt_index,
        sample_index=sample_index,
        messages=[dict(message) for message in record.prompt],
        data_source=record.data_source,
        ground_truth=record.ground_truth,
        tools_kwargs=record.tools_kwargs,
        extra=record.extra,
    )
