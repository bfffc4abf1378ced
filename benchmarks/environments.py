"""Step environments at high concurrency: does a slow ``step`` stall the event loop?

    python -m benchmarks.environments [--concurrency 256] [--requests 256] [--steps 4] [--sleep-ms 0 50]
                                      [--blocking-requests 16] [--json FILE]

Each request is one episode of ``SleepEnv`` (below, a user's class by import path:
``benchmarks.environments:SleepEnv``) through ``EnvironmentInteraction`` on the embedded engine: reset
gives the first user message, each assistant turn (``--new-tokens`` tokens) is a ``step`` that sleeps
``--sleep-ms`` in the interaction's worker threads (the env is sync), the episode ends after ``--steps``
steps. One row per sleep; then a pair at ``--blocking-requests`` episodes (few, so that it ends in
seconds) and the largest sleep: ``SleepEnv`` again, and ``BlockingEnv``, the mistake the worker threads
avoid: an ``async def step`` that calls ``time.sleep`` and so runs, and blocks, on the event loop.

Reported per row:

- env steps/s: steps taken by all episodes / wall time of the rollout;
- env share: the time requests spent inside environment calls (``EnvironmentInteraction.stats.step_seconds``:
  make, reset and step calls, summed over requests) / (wall time x requests in flight): the share of the
  request slots that waited on the environment;
- ms/step: that time / steps: the sleep plus the wait for a worker thread (or for the loop);
- loop lag p50 / p99 / max: a ticker coroutine sleeps 5 ms again and again while the rollout runs; each
  wake-up's lateness is the event loop's lag (a stalled loop answers nothing: HTTP, timeouts, engines);
- loop stalled: the lags longer than 10 ms summed / wall time: the share of the run the loop was stuck.

A warm-up episode per slot (one step, not reported) comes first. Every row samples with the same
seed, so its episodes take the same moves (the same steps) whatever the sleep. The engine's model runs
in its own thread; the loop's own work (rendering turns, parsing) and its wait for the GIL (the engine's
thread, the worker threads) show in the lag of every row: compare rows, not a row with zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.waits import WaitTimeout, finish_within
from data.env_tasks import make_env_records
from data.tiny_model import EMBEDDED_MODEL
from rollout.config import RolloutConfig
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.envs.interaction import EnvironmentInteraction
from rollout.runner import RolloutRunner
from rollout.serve.processes import stop_on_sigterm
from rollout.tokens import ChatTokenizer, load_tokenizer

TICK_S = 0.005
"""The ticker's sleep: each wake-up later than this is event-loop lag."""
STALL_S = 0.010
"""A lag longer than this is a stall (shorter ones are the timer's own granularity and the loop's turns)."""


class SleepEnv:
    """A gymnasium-style environment whose ``step`` sleeps ``sleep_s`` (sync: it runs in a worker thread)."""

    def __init__(self, sleep_s: float = 0.05, steps: int = 4):
        self.sleep_s, self.steps, self.n = sleep_s, steps, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.n = 0
        return f"Game {seed}: make {self.steps} moves.", {}

    def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        time.sleep(self.sleep_s)
        self.n += 1
        return f"Move {self.n} taken.", float(bool(action.strip())), self.n >= self.steps, False, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._step(action)


class BlockingEnv(SleepEnv):
    """The same sleep in an ``async def step``: awaited on the event loop, which it blocks."""

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        return self._step(action)


@dataclass
class Row:
    env: str
    sleep_ms: float
    requests: int
    in_flight: int
    wall_s: float
    steps: int
    steps_per_s: float
    env_share: float
    ms_per_step: float
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    loop_stalled: float
    errors: int


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep ``TICK_S`` until ``stop``; append each wake-up's lateness (seconds)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(TICK_S)
        lags.append(max(0.0, loop.time() - before - TICK_S))


async def one_row(
    engine: LocalEngine, chat: ChatTokenizer, env_class: str, sleep_ms: float, args: argparse.Namespace, requests: int
) -> Row:
    spec = f"benchmarks.environments:{env_class}"
    interaction = EnvironmentInteraction(
        {"name": "env", "env": spec, "env_kwargs": {"sleep_s": sleep_ms / 1000, "steps": args.steps},
         "threads": args.threads, "check": False}
    )  # fmt: skip
    records = make_env_records(spec, requests, seed=0, env_kwargs={"sleep_s": sleep_ms / 1000, "steps": args.steps})
    config = RolloutConfig(max_new_tokens=args.new_tokens, max_turns=args.steps + 1, max_concurrency=args.concurrency,
                           seed=0, interaction_timeout_s=600.0, tool_reward_timeout_s=600.0)  # fmt: skip
    runner = RolloutRunner(engine, chat, {}, config, interactions={"env": interaction}, progress=False)
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(lags, stop))
    started = time.perf_counter()
    try:
        async with interaction:
            result = await finish_within(
                runner.run(records), args.run_timeout_s, f"{env_class}'s rollout", "--run-timeout-s"
            )
    finally:
        stop.set()
        await tick
    wall = time.perf_counter() - started
    stats = interaction.stats
    errors = sum(r.error is not None for r in result.requests)
    lag_ms = np.array(lags or [0.0]) * 1000
    in_flight = min(requests, args.concurrency)
    return Row(
        env=env_class, sleep_ms=sleep_ms, requests=requests, in_flight=in_flight, wall_s=wall,
        steps=stats.steps, steps_per_s=stats.steps / wall, env_share=stats.step_seconds / (wall * in_flight),
        ms_per_step=1000 * stats.step_seconds / max(stats.steps, 1), lag_p50_ms=float(np.percentile(lag_ms, 50)),
        lag_p99_ms=float(np.percentile(lag_ms, 99)), lag_max_ms=float(lag_ms.max()),
        loop_stalled=float(lag_ms[lag_ms > STALL_S * 1000].sum()) / 1000 / wall, errors=errors,
    )  # fmt: skip


async def main_async(args: argparse.Namespace) -> list[Row]:
    chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [])
    engine_config = LocalEngineConfig(max_batch_size=args.concurrency, device="cpu", seed=0)
    rows = []
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL, engine_config) as engine:
        warm_up = argparse.Namespace(**{**vars(args), "steps": 1})  # the engine's first full batch, not measured
        await one_row(engine, chat, "SleepEnv", 0.0, warm_up, min(args.requests, args.concurrency))
        for sleep_ms in args.sleep_ms:
            rows.append(await one_row(engine, chat, "SleepEnv", sleep_ms, args, args.requests))
        if args.blocking_requests:  # the same load in worker threads, then on the loop
            for env_class in ("SleepEnv", "BlockingEnv"):
                rows.append(await one_row(engine, chat, env_class, max(args.sleep_ms), args, args.blocking_requests))
    return rows


def print_table(rows: list[Row], console: Console) -> None:
    table = Table(title=f"Step environments on the embedded engine (ticker every {TICK_S * 1000:g} ms)")
    for column in ("env", "sleep ms", "requests", "in flight", "wall s", "steps", "env steps/s", "env share",
                   "ms/step", "lag p50 ms", "lag p99 ms", "lag max ms", "loop stalled", "errors"):  # fmt: skip
        table.add_column(column, justify="left" if column == "env" else "right", no_wrap=column == "env")
    for r in rows:
        table.add_row(r.env, f"{r.sleep_ms:g}", str(r.requests), str(r.in_flight), f"{r.wall_s:.1f}", str(r.steps),
                      f"{r.steps_per_s:.1f}", f"{r.env_share:.1%}", f"{r.ms_per_step:.1f}", f"{r.lag_p50_ms:.1f}",
                      f"{r.lag_p99_ms:.1f}", f"{r.lag_max_ms:.0f}", f"{r.loop_stalled:.1%}", str(r.errors))  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.environments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight (and the engine's batch)")
    parser.add_argument("--requests", type=int, default=256, help="episodes per SleepEnv row")
    parser.add_argument("--steps", type=int, default=4, help="steps per episode")
    parser.add_argument(
        "--sleep-ms", type=float, nargs="+", default=[0.0, 50.0], help="SleepEnv's step sleeps, a row each"
    )
    parser.add_argument("--blocking-requests", type=int, default=16,
                        help="episodes of BlockingEnv (the largest --sleep-ms, on the loop); 0: none")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64, help="most tokens per assistant turn")
    parser.add_argument("--threads", type=int, default=256, help="the interaction's worker threads")
    parser.add_argument("--run-timeout-s", type=float, default=600.0, help="deadline of one row's rollout")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if min(args.concurrency, args.requests, args.steps, args.new_tokens, args.threads) < 1:
        parser.error("--concurrency, --requests, --steps, --new-tokens and --threads must be at least 1")
    with stop_on_sigterm():
        try:
            rows = asyncio.run(main_async(args))
        except WaitTimeout as exc:
            raise SystemExit(f"benchmarks.environments: {exc}") from None
    print_table(rows, Console(width=max(Console().width, 150)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
