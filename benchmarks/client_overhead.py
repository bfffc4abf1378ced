"""Where a turn's client CPU goes, piece by piece, measured inside a real W1 run.

    python -m benchmarks.client_overhead [--requests 1024]

rallyrl runs W1 (``benchmarks/workloads.py``) against the simulated server, as ``rallyrl bench``
runs it, with each piece of a turn wrapped in a CPU-time meter (``time.thread_time`` around
every call, and around every step of the coroutines); the time of a piece excludes the pieces
called inside it. Pieces done once per request (the prompt, the final consistency check, the
tool's create and release) are divided among the request's turns. The bare client
(``benchmarks/bare_client.py``) runs the same workload after it, metered the same way, for
the ratio. The meters cost a few microseconds a turn themselves: the totals are a little above
``rallyrl bench``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

import rollout.engines.sglang_http as sglang_http
import rollout.loop as loop
import rollout.runner as runner
from benchmarks import clients
from benchmarks.bare_client import BareClient
from benchmarks.sim_server import raise_fd_limit
from benchmarks.sim_tools import SimTool
from benchmarks.tool_concurrency import RUN_TIMEOUT_S, sim_server
from benchmarks.waits import finish_within
from benchmarks.workloads import W1, Scenario
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.request import AsyncRolloutRequest
from rollout.serve.processes import stop_on_sigterm
from rollout.tokens import ChatTokenizer


class Meter:
    """Exclusive CPU time per label: a piece's time, less the metered pieces inside it."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._stack: list[list[Any]] = []

    def enter(self, label: str) -> None:
        self._stack.append([label, time.thread_time(), 0.0])

    def exit(self) -> None:
        label, start, inner = self._stack.pop()
        spent = time.thread_time() - start
        self.seconds[label] += spent - inner
        if self._stack:
            self._stack[-1][2] += spent

    def sync(self, function: Any, label: str) -> Any:
        def metered(*args: Any, **kwargs: Any) -> Any:
            self.enter(label)
            try:
                return function(*args, **kwargs)
            finally:
                self.exit()

        return metered

    def coroutine(self, function: Any, label: str) -> Any:
        """Every step of the coroutine ``function`` returns is metered."""
        meter = self

        @types.coroutine
        def stepped(coroutine: Any) -> Any:
            value, error = None, None
            while True:
                meter.enter(label)
                try:
                    waiting_on = coroutine.throw(error) if error is not None else coroutine.send(value)
                except StopIteration as done:
                    return done.value
                finally:
                    meter.exit()
                value, error = None, None
                try:
                    value = yield waiting_on
                except BaseException as exc:  # cancellation, passed on
                    error = exc

        async def metered(*args: Any, **kwargs: Any) -> Any:
            return await stepped(function(*args, **kwargs))

        return metered


SYNC = {  # (owner, attribute): piece
    (ChatTokenizer, "prompt"): "render + tokenize the first prompt (once per request)",
    (ChatTokenizer, "delta"): "tool result: render (cached template pieces) + tokenize",
    (ChatTokenizer, "add_output"): "incremental check: the output's segment",
    (ChatTokenizer, "add_context"): "incremental check: glue and tool result",
    (ChatTokenizer, "check_consistency"): "final check: re-render, compare text (once per request)",
    (ChatTokenizer, "assistant_text"): "decode the output",
    (sglang_http, "parse_generation"): "read the response (ids, logprobs, finish reason)",
    (AsyncRolloutRequest, "transition"): "trace (state transitions)",
    (AsyncRolloutRequest, "append_generated"): "token lists (ids, mask, logprobs, versions)",
    (AsyncRolloutRequest, "append_context"): "token lists (ids, mask, logprobs, versions)",
}
ASYNC = {
    (SGLangHTTPEngine, "generate"): "HTTP round trip (engine client, http_wire)",
    (SimTool, "create"): "the tool itself (create, execute, reward, release)",
    (SimTool, "execute"): "the tool itself (create, execute, reward, release)",
    (SimTool, "calc_reward"): "the tool itself (create, execute, reward, release)",
    (SimTool, "release"): "the tool itself (create, execute, reward, release)",
    (loop, "_call_tools"): "tool-call bookkeeping (records, arguments, timeout)",
    (runner, "run_request"): "the rest of run_request (loop, parse the call, sampling, reward)",
}
BARE = {(BareClient, "one"): "bare client: its request coroutines"}


@contextlib.contextmanager
def metered(meter: Meter, sync: dict, coroutines: dict) -> Iterator[None]:
    """The pieces wrapped in ``meter`` while inside (methods on their class, functions in their module)."""
    originals = {key: key[0].__dict__.get(key[1]) for key in [*sync, *coroutines]}
    try:
        for (owner, name), label in sync.items():
            setattr(owner, name, meter.sync(getattr(owner, name), label))
        for (owner, name), label in coroutines.items():
            wrapped = meter.coroutine(getattr(owner, name), label)
            if isinstance(owner, type):  # a method: a function, so that it binds like the original
                setattr(owner, name, lambda self, *args, _wrapped=wrapped, **kwargs: _wrapped(self, *args, **kwargs))
            else:
                setattr(owner, name, wrapped)
        yield
    finally:
        for (owner, name), original in originals.items():
            if original is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, original)


def breakdown(requests: int, run_timeout_s: float = RUN_TIMEOUT_S) -> tuple[list[tuple[str, float]], float, float,
                                                                           float]:  # fmt: skip
    """(piece, us per turn) for rallyrl, its total, the bare client's total and its coroutines' part;
    WaitTimeout when a client's run takes longer than ``run_timeout_s``."""
    raise_fd_limit()
    scenario = Scenario.build(dataclasses.replace(W1, requests=requests))
    meter = Meter()
    with sim_server(scenario) as (url, _), metered(meter, SYNC, ASYNC):
        run = asyncio.run(finish_within(clients.run_rallyrl(scenario, url), run_timeout_s, "the rallyrl run",
                                        "--run-timeout-s"))  # fmt: skip
    turns = run.turns
    rows = [(label, seconds / turns * 1e6) for label, seconds in meter.seconds.most_common()]
    outside = run.cpu_s - sum(meter.seconds.values())
    rows.append(("outside the requests: event loop, sockets, runner", outside / turns * 1e6))
    bare_meter = Meter()
    scenario = Scenario.build(dataclasses.replace(W1, requests=requests))
    with sim_server(scenario) as (url, _), metered(bare_meter, {}, BARE):
        bare = asyncio.run(finish_within(clients.run_bare(scenario, url), run_timeout_s, "the bare client's run",
                                         "--run-timeout-s"))  # fmt: skip
    bare_inside = sum(bare_meter.seconds.values()) / bare.turns * 1e6
    return rows, run.cpu_s / turns * 1e6, bare.cpu_s / bare.turns * 1e6, bare_inside


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=W1.requests)
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S, help="deadline of each client's run")
    args = parser.parse_args()
    rows, total, bare, bare_inside = breakdown(args.requests, args.run_timeout_s)
    table = Table(title=f"client CPU per W1 turn, by piece ({args.requests} requests, meters on)")
    table.add_column("piece")
    table.add_column("us / turn", justify="right")
    for name, us in rows:
        table.add_row(name, f"{us:.1f}")
    table.add_row("rallyrl, total", f"{total:.1f}")
    table.add_row("bare client, total", f"{bare:.1f}")
    table.add_row("  of which in its request coroutines", f"{bare_inside:.1f}")
    table.add_row("ratio", f"{total / bare:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
