"""What the agent gateway costs per call, against rallyrl's native loop on the same conversations.

    python -m benchmarks.gateway_overhead [--quick] [--conversations 64] [--rounds 5] [--sessions 1000]

(a) The same calc conversations (``data.synthetic.make_calc_records``) run three ways on one engine:
``native``, ``rollout.loop.run_request`` with the calculator tool; through an in-process ``Gateway``
driven by ``rollout.gateway.agents.AgentDriver`` (as ``rallyrl train`` runs an agent), ``aiohttp``, the
``data.agents.calc_openai`` loop over one shared aiohttp session (what the gateway itself costs),
and ``openai``, ``calc_openai.run`` as written (``openai.AsyncOpenAI``, a new client per run). The
rounds rotate the order of the ways, ``--rounds`` of each, on two engines: a deterministic double
(``CalcEngine``: the ideal agent's turns, after ``--latency-ms``) that leaves only rallyrl's own
work to measure, and the embedded model. Reported per engine call: process CPU
(``time.process_time``; everything in this process: loop or agent, SDK, HTTP, gateway; with the
embedded model, the model's compute too), wall time (a round's wall over its calls, at
``--concurrency`` conversations at once), what each gateway way adds to the native round run next
to it, and the ratio.

(b) ``--sessions`` sessions open at once: a client process (``benchmarks/gateway_sessions.py``) opens
them, makes each one's two calls (on the double) and holds them open; this process's RSS (the
gateway's) is read before, at that point, at its peak, and after they are finished. The client
process has ``--sessions-timeout-s`` (600) to open them, and as long to finish them.

Prints tables; asserts only that both ways record the same tokens on the double.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil
from rich.console import Console
from rich.table import Table

from benchmarks.waits import finish_within
from data.agents import calc_openai
from data.schema import Record
from data.synthetic import calc_trace, make_calc_records
from rollout.api import open_engine, resolve_model
from rollout.config import EngineConfig, GatewayConfig, RolloutConfig
from rollout.engines.base import Generation, SamplingParams
from rollout.gateway import Gateway
from rollout.gateway.agents import AgentDriver
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest
from rollout.runner import old_objects_frozen, request_from_record
from rollout.serve.processes import stop_on_sigterm
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.calculator import CalculatorTool

SESSIONS_TIMEOUT_S = 600.0
"""Deadline of (b)'s client process opening its sessions, and of its finishing them."""

# ----- the engine double ------------------------------------------------------------------------------


@dataclass
class CalcEngine:
    """A deterministic engine: for request ``r{i}`` (any rid that starts so), the ideal agent's turns of
    record ``i`` (a calculator call, then ``\\boxed{result}``), chosen by how many tool responses the
    prompt holds, after ``latency_s``. Answers are tokenized once, up front: it costs next to no CPU."""

    answers: list[list[list[int]]]  # per record, the token ids of each assistant turn
    tool_response_id: int
    latency_s: float = 0.0
    calls: int = 0

    @classmethod
    def for_records(cls, records: list[Record], chat: ChatTokenizer, latency_s: float) -> CalcEngine:
        close = chat.turn_close_ids[0]
        answers = [[[*chat.encode(m["content"]), close] for m in calc_trace(r) if m["role"] == "assistant"]
                   for r in records]  # fmt: skip
        return cls(answers, chat.tokenizer.convert_tokens_to_ids("<tool_response>"), latency_s)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.calls += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        turns = self.answers[int(rid.split("-", 1)[0][1:])]
        ids = turns[min(input_ids.count(self.tool_response_id), len(turns) - 1)][: sampling.max_new_tokens]
        return Generation(ids, [-0.5] * len(ids), "stop", 0)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        return 0

    async def abort(self, rid: str | None = None) -> None:
        return None

    async def health(self) -> bool:
        return True


class Counted:
    """An engine whose ``generate`` calls are counted (the embedded model's)."""

    def __init__(self, engine: Any):
        self.engine, self.calls = engine, 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.calls += 1
        return await self.engine.generate(input_ids, sampling, rid)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        return await self.engine.update_weights(state_dict, weight_version)

    async def abort(self, rid: str | None = None) -> None:
        await self.engine.abort(rid)

    async def health(self) -> bool:
        return await self.engine.health()


# ----- (a) per call: native loop vs the agent through the gateway -------------------------------------------


@dataclass
class Rounds:
    """What each round of one way measured: CPU and wall seconds, engine calls."""

    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)

    def per_call_ms(self, name: str) -> list[float]:
        return [s / c * 1e3 for s, c in zip(getattr(self, name), self.calls, strict=True)]


async def bounded(coroutines: list[Awaitable[AsyncRolloutRequest]], limit: int) -> list[AsyncRolloutRequest]:
    semaphore = asyncio.Semaphore(limit)

    async def one(coroutine: Awaitable[AsyncRolloutRequest]) -> AsyncRolloutRequest:
        async with semaphore:
            return await coroutine

    return await asyncio.gather(*(one(c) for c in coroutines))


Requests = list[AsyncRolloutRequest]
WAYS = {
    "native": "native loop (run_request)",
    "aiohttp": "aiohttp agent via gateway",
    "openai": "calc_openai agent via gateway",
}
"""The ways a conversation is run: the native loop; through the gateway, by a bare agent (one shared
aiohttp session: the gateway's own cost) and by ``calc_openai`` as written (a new ``AsyncOpenAI`` per run)."""


def aiohttp_agent(http: aiohttp.ClientSession) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
    """``calc_openai.run``'s loop over a shared aiohttp session instead of the openai SDK."""

    async def run(base_url: str, record: dict[str, Any]) -> None:
        messages: list[dict[str, Any]] = list(record["prompt"])
        for _ in range(calc_openai.MAX_TURNS):
            body = {"model": "rallyrl", "messages": messages, "tools": [calc_openai.CALCULATOR]}
            async with http.post(f"{base_url}/chat/completions", json=body) as response:
                message = (await response.json())["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            if not message.get("tool_calls"):
                return
            messages += [{"role": "tool", "tool_call_id": call["id"], "content": calc_openai.calculator(
                call["function"]["arguments"])} for call in message["tool_calls"]]  # fmt: skip

    return run


async def compare(engine: Any, tokenizer: Any, records: list[Record], config: RolloutConfig, rounds: int,
                  concurrency: int) -> tuple[dict[str, Rounds], dict[str, Requests]]:  # fmt: skip
    """``rounds`` rounds of each way, the order rotating; the measurements, and each way's first requests."""
    tool = CalculatorTool()
    chat = ChatTokenizer(tokenizer, [tool.schema])
    tags = iter(range(10**9))

    def requests() -> Requests:  # ids unique across rounds (a finished session's id stays taken)
        tag = next(tags)
        return [request_from_record(r, i, 0, f"r{i}-{tag}") for i, r in enumerate(records)]

    gateway = Gateway(engine, tokenizer, GatewayConfig(max_sessions=len(records) + 1), config)
    async with gateway, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        bare = AgentDriver(gateway, aiohttp_agent(http), timeout_s=600)
        sdk = AgentDriver(gateway, calc_openai.run, timeout_s=600)
        ways: dict[str, Callable[[], list[Awaitable[AsyncRolloutRequest]]]] = {
            "native": lambda: [run_request(r, engine, chat, {"calculator": tool}, config) for r in requests()],
            "aiohttp": lambda: [bare.run(r) for r in requests()],
            "openai": lambda: [sdk.run(r) for r in requests()],
        }
        results = {name: Rounds() for name in ways}
        first: dict[str, Requests] = {}
        for _ in range(2):  # warm up every way (imports, caches, connections)
            for name, way in ways.items():
                first.setdefault(name, await bounded(way(), concurrency))
        names = list(ways)
        for index in range(rounds):
            for name in names[index % len(names) :] + names[: index % len(names)]:
                calls0, cpu0, wall0 = engine.calls, time.process_time(), time.perf_counter()
                with old_objects_frozen():  # as RolloutRunner.run rolls out (the garbage collector's share)
                    await bounded(ways[name](), concurrency)
                results[name].wall_s.append(time.perf_counter() - wall0)
                results[name].cpu_s.append(time.process_time() - cpu0)
                results[name].calls.append(engine.calls - calls0)
    return results, first


def same_tokens(first: dict[str, Requests]) -> bool:
    """Whether every way recorded the same tokens for every conversation."""

    def tokens(requests: Requests) -> list[Any]:
        return [(r.prompt_ids, r.response_ids, r.loss_mask) for r in requests]

    return all(tokens(requests) == tokens(first["native"]) for requests in first.values())


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def overhead_table(title: str, results: dict[str, Rounds]) -> Table:
    table = Table(title=title, caption="median \\[min-max] over rounds; + and x: each round against the native round "
                                       "run next to it (same index)")  # fmt: skip
    for column in ("way", "calls/round", "CPU ms/call", "+CPU ms/call", "x CPU", "wall ms/call", "+wall ms/call",
                   "x wall", "calls/s"):  # fmt: skip
        table.add_column(column, justify="left" if column == "way" else "right")
    native = results["native"]
    for name, label in WAYS.items():
        r = results[name]
        cells = []
        for measure in ("cpu_s", "wall_s"):
            mine, base = r.per_call_ms(measure), native.per_call_ms(measure)
            added = [m - b for m, b in zip(mine, base, strict=True)]
            ratio = [m / b for m, b in zip(mine, base, strict=True)]
            cells += [spread(mine)] + (["", ""] if name == "native" else [spread(added), spread(ratio, 1)])
        rate = statistics.median(c / w for c, w in zip(r.calls, r.wall_s, strict=True))
        table.add_row(label, f"{statistics.median(r.calls):.0f}", *cells, f"{rate:.0f}")
    return table


# ----- (b) many sessions at once: the gateway's memory --------------------------------------------------------


async def session_memory(tokenizer: Any, count: int, latency_s: float, trace: bool,
                         timeout_s: float = SESSIONS_TIMEOUT_S) -> dict[str, float]:  # fmt: skip
    """RSS of this process (the gateway's) with ``count`` sessions open after two calls each; with
    ``trace``, also the Python heap they hold (``tracemalloc``: exact, but slower and its own memory
    inflates the RSS). WaitTimeout when the client process takes longer than ``timeout_s`` to open
    the sessions, or to finish them (it is killed)."""
    records = make_calc_records(min(count, 256))
    chat = ChatTokenizer(tokenizer, [calc_openai.CALCULATOR])
    engine = CalcEngine.for_records(records, chat, latency_s)
    me = psutil.Process()
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, me.memory_info().rss)
            await asyncio.sleep(0.01)

    config = GatewayConfig(max_sessions=count + 1)
    async with Gateway(engine, tokenizer, config, RolloutConfig(max_turns=3)) as gateway:
        rss_before = me.memory_info().rss
        if trace:
            tracemalloc.start()
        sampler = asyncio.create_task(sample())
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.gateway_sessions", gateway.url, str(count), str(len(records)),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert client.stdin is not None and client.stdout is not None
        try:
            started = time.perf_counter()
            what = f"(b)'s client process, opening {count} sessions"
            line = await finish_within(client.stdout.readline(), timeout_s, what, "--sessions-timeout-s")
            if line.strip() != b"ready":
                raise RuntimeError(f"the client process failed: {line!r}; {await client.stdout.read()!r}")
            opened_s = time.perf_counter() - started
            rss_open, open_now, calls = me.memory_info().rss, len(gateway.sessions), gateway.counters["calls"]
            heap_open = tracemalloc.get_traced_memory()[0] if trace else math.nan
            client.stdin.write(b"finish\n")
            what = f"(b)'s client process, finishing {count} sessions"
            await finish_within(client.communicate(), timeout_s, what, "--sessions-timeout-s")
        finally:
            if client.returncode is None:
                client.kill()
                await client.wait()
            sampler.cancel()
        rss_after, kept = me.memory_info().rss, len(gateway.finished)
        heap_after = tracemalloc.get_traced_memory()[0] if trace else math.nan
        tracemalloc.stop()
    return {"sessions": open_now, "calls": calls, "open_s": opened_s, "before_mb": rss_before / 2**20,
            "open_mb": rss_open / 2**20, "peak_mb": peak / 2**20, "after_mb": rss_after / 2**20,
            "per_session_kb": (rss_open - rss_before) / max(open_now, 1) / 1024, "kept": kept,
            "heap_per_session_kb": heap_open / max(open_now, 1) / 1024,
            "heap_after_mb": heap_after / 2**20}  # fmt: skip


def memory_table(runs: list[dict[str, float]]) -> Table:
    table = Table(title=f"(b) {int(runs[0]['sessions'])} sessions open at once (gateway process RSS)")
    for column in ("run", "calls", "open+2 calls s", "RSS before MB", "with sessions open MB", "peak MB",
                   "after finish MB", "RSS per open session KiB", "heap per open session KiB",
                   "heap after finish MB", "finished kept"):  # fmt: skip
        table.add_column(column, justify="right")
    for i, run in enumerate(runs, 1):
        traced = not math.isnan(run["heap_per_session_kb"])
        table.add_row(f"{i}{' (traced)' if traced else ''}", f"{run['calls']:.0f}", f"{run['open_s']:.1f}",
                      f"{run['before_mb']:.0f}", f"{run['open_mb']:.0f}", f"{run['peak_mb']:.0f}",
                      f"{run['after_mb']:.0f}", f"{run['per_session_kb']:.1f}",
                      f"{run['heap_per_session_kb']:.1f}" if traced else "-",
                      f"{run['heap_after_mb']:.1f}" if traced else "-", f"{run['kept']:.0f}")  # fmt: skip
    table.caption = ("RSS: the first run is in a fresh process (later runs reuse memory freed before); heap: "
                     "Python allocations the gateway holds, traced from just before the sessions open")  # fmt: skip
    return table


# ----- main ------------------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    console = Console(width=200)
    load = os.getloadavg()
    console.print(f"CPUs {os.cpu_count()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.rounds} "
                  f"rounds per way, concurrency {args.concurrency}")  # fmt: skip
    model_dir = resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    records = make_calc_records(args.conversations)
    config = RolloutConfig(max_turns=calc_openai.MAX_TURNS, seed=0, max_model_len=1024)

    runs = [await session_memory(tokenizer, args.sessions, args.latency_ms / 1e3, i > 0, args.sessions_timeout_s)
            for i in range(args.memory_runs)]  # fmt: skip
    console.print(memory_table(runs))

    chat = ChatTokenizer(tokenizer, [CalculatorTool().schema])
    double = CalcEngine.for_records(records, chat, args.latency_ms / 1e3)
    results, first = await compare(double, tokenizer, records, config, args.rounds, args.concurrency)
    console.print(overhead_table(f"(a) engine double, {args.latency_ms:g} ms per call, {len(records)} "
                                 "conversations per round", results))  # fmt: skip
    if not same_tokens(first):
        raise SystemExit("the ways recorded different tokens: the comparison is not like for like")
    console.print("same tokens recorded every way: yes")

    embedded_records = records[: args.embedded_conversations]
    async with open_engine(EngineConfig(), model_dir, max_model_len=1024) as local:
        results, first = await compare(Counted(local), tokenizer, embedded_records, config, args.rounds,
                                       args.concurrency)  # fmt: skip
    console.print(overhead_table(f"(a) embedded model, {len(embedded_records)} conversations per round", results))
    why = "no (an agent ends a conversation at an answer without a parsable call; the loop goes on)"
    console.print(f"same tokens recorded every way: {'yes' if same_tokens(first) else why}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations, rounds and sessions (< 1 min)")
    parser.add_argument("--conversations", type=int, default=64, help="calc conversations per round (double)")
    parser.add_argument("--embedded-conversations", type=int, default=32, help="per round with the embedded model")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each way, alternating")
    parser.add_argument("--concurrency", type=int, default=16, help="conversations at once")
    parser.add_argument("--latency-ms", type=float, default=2.0, help="the double's time per call")
    parser.add_argument("--sessions", type=int, default=1000, help="sessions open at once in (b)")
    parser.add_argument("--memory-runs", type=int, default=2, help="repetitions of (b); all but the first traced")
    parser.add_argument("--sessions-timeout-s", type=float, default=SESSIONS_TIMEOUT_S,
                        help="deadline of (b)'s client process opening the sessions, and finishing them")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.embedded_conversations, args.rounds = 32, 8, 3
        args.sessions = min(args.sessions, 1000)
    return args


if __name__ == "__main__":
    with stop_on_sigterm():
        asyncio.run(main(parse_args()))
