"""Fan-out of a batch: records x n samples as concurrent requests, streamed to JSONL as they finish.

Results come back in (prompt_index, sample_index) order whatever order they finish in.
The JSONL file holds one line per finished trajectory in finishing order, flushed as each
finishes, so an interrupted run keeps everything it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from data.schema import Record
from rollout.engines.base import Engine
from rollout.loop import RewardFn, RolloutConfig, default_reward, run_request
from rollout.request import AsyncRolloutRequest
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool


@dataclass
class RolloutSummary:
    """Aggregates of one rollout, as printed and as logged."""

    requests: int = 0
    prompts: int = 0
    samples_per_prompt: int = 1
    mean_reward: float = 0.0  # over the requests whose reward is not missing
    rewards_missing: int = 0  # requests without a reward (a failed judgment)
    accuracy: float | None = None  # share of graded requests whose answer is right
    pass_at_n: float | None = None  # share of graded prompts with at least one right answer
    mean_turns: float = 0.0
    mean_tool_calls: float = 0.0
    tool_errors: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    consistency_failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def table(self) -> Table:
        table = Table(title="rollout summary", show_header=False)
        for key, value in self.to_dict().items():
            if isinstance(value, float):
                value = f"{value:.4g}"
            elif isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
            table.add_row(key.replace("_", " "), "-" if value is None else str(value))
        return table


def summarize(requests: list[AsyncRolloutRequest], wall_s: float, samples_per_prompt: int) -> RolloutSummary:
    """Rewards, accuracy, pass@n, turns, tool calls, finish reasons and throughput of a batch."""
    count = len(requests) or 1
    graded = [r for r in requests if r.rewards.answer is not None]
    by_prompt: dict[int, bool] = {}
    for r in graded:
        by_prompt[r.prompt_index] = by_prompt.get(r.prompt_index, False) or r.rewards.answer == 1.0
    tokens = sum(r.metrics.generated_tokens for r in requests)
    rewards = [r.rewards.final for r in requests if r.rewards.final is not None and not math.isnan(r.rewards.final)]
    return RolloutSummary(
        requests=len(requests),
        prompts=len({r.prompt_index for r in requests}),
        samples_per_prompt=samples_per_prompt,
        mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        rewards_missing=len(requests) - len(rewards),
        accuracy=sum(r.rewards.answer == 1.0 for r in graded) / len(graded) if graded else None,
        pass_at_n=sum(by_prompt.values()) / len(by_prompt) if by_prompt else None,
        mean_turns=sum(r.metrics.turns for r in requests) / count,
        mean_tool_calls=sum(r.metrics.tool_calls for r in requests) / count,
        tool_errors=sum(r.metrics.tool_errors for r in requests),
        finish_reasons=dict(Counter(r.finish_reason.value for r in requests if r.finish_reason)),
        generated_tokens=tokens,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        wall_s=wall_s,
        consistency_failures=sum(r.consistency_diff is not None for r in requests),
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
        max_concurrency: int = 64,
        reward_fn: RewardFn = default_reward,
        progress: bool = True,
        console: Console | None = None,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.engine, self.chat, self.tools = engine, chat, tools
        self.config = config or RolloutConfig()
        self.max_concurrency = max_concurrency
        self.reward_fn = reward_fn
        self.progress = progress
        self.console = console or Console(stderr=True)

    async def run(
        self,
        records: list[Record],
        n: int = 1,
        out_path: str | Path | None = None,
        prompt_indices: list[int] | None = None,
        skip: Collection[tuple[int, int]] = (),
        append: bool = False,
    ) -> RolloutResult:
        """Roll out every record ``n`` times; stream finished trajectories to ``out_path`` (JSONL).
        ``prompt_indices`` numbers the records (default 0, 1, ...), e.g. by their place in a
        batch split over processes. ``skip`` holds (prompt_index, sample_index) pairs already
        done (a resumed run, see ``read_finished``); ``append`` adds to ``out_path``."""
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        indices = list(range(len(records))) if prompt_indices is None else prompt_indices
        if len(indices) != len(records):
            raise ValueError(f"{len(indices)} prompt indices for {len(records)} records")
        run_id = uuid.uuid4().hex[:8]
        skip = set(skip)
        total = sum((p, s) not in skip for p in indices for s in range(n))
        requests = (  # built as they are started, so the first ones leave at once
            request_from_record(record, prompt_index, sample_index, f"{run_id}-{prompt_index}-{sample_index}")
            for prompt_index, record in zip(indices, records, strict=True)
            for sample_index in range(n)
            if (prompt_index, sample_index) not in skip
        )
        semaphore = asyncio.Semaphore(self.max_concurrency)
        live = _LiveCounts()
        started = time.monotonic()
        out = _open_output(out_path, append)
        progress = self._progress_bar(total)

        async def one(request: AsyncRolloutRequest) -> AsyncRolloutRequest:
            async with semaphore:
                live.running += 1
                try:
                    await run_request(request, self.engine, self.chat, self.tools, self.config, self.reward_fn)
                finally:
                    live.running -= 1
            live.finished(request)
            if out is not None:
                out.write(orjson.dumps(request.to_record()) + b"\n")
                out.flush()
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
        return RolloutResult(list(done), summarize(list(done), time.monotonic() - started, n))

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


def _open_output(path: str | Path | None, append: bool = False) -> IO[bytes] | None:
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("ab" if append else "wb")


def read_finished(path: str | Path) -> set[tuple[int, int]]:
    """The (prompt_index, sample_index) pairs of the trajectories in a rollout JSONL, to resume it.

    Each trajectory is one line written whole, so only a kill in the middle of a write leaves a
    broken line, and it is the last one, without its newline: it is dropped from the file
    (rewritten atomically). A broken line anywhere else is an error naming it.
    """
    path = Path(path)
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    finished: set[tuple[int, int]] = set()
    for number, line in enumerate(complete.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
            finished.add((int(record["prompt_index"]), int(record["sample_index"])))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path} line {number}: not a trajectory, so the run cannot resume from it") from None
    if len(complete) < len(raw):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(complete)
        os.replace(tmp, path)
    return finished


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
