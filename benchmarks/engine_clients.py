"""The two clients ``benchmarks/engines.py`` compares on one server, and what it measures of each.

- ``TimedEngine`` wraps the engine rallyrl's runner drives and notes every ``generate`` call
  (request, start, end, prompt and output tokens; where the server says, its cached prompt tokens
  and its own latency).
- ``replay_calls`` reads back, from rallyrl's trajectories, the generation calls it made: each
  run of ``loss_mask`` 1 is one turn's output, and ``prompt_ids + response_ids`` before it is that
  turn's input.
- ``RawClient`` sends those calls again as plain HTTP requests by token ids, with no rollout logic
  (no chat template, no parser, no tools): SGLang's ``/generate`` (SGLang and ``rallyrl serve``) or
  vLLM's ``/v1/completions``. Each replayed call asks for exactly the tokens rallyrl got
  (``max_new_tokens`` = that turn's output length, EOS ignored), so both clients ask the server
  for the same prefill and the same decode steps.
- ``CallProfile`` sums the calls of one run up: calls in flight, latency, gaps between a
  request's turns, cached prompt tokens; ``CpuMeter`` the CPU this process, the server and
  everything else on the machine used meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from rollout.engines.base import Generation, SamplingParams

Protocol = Literal["sglang", "vllm"]
"""What a server speaks: SGLang's native API (SGLang, ``rallyrl serve``) or vLLM's OpenAI API."""


def cpu_seconds() -> float:
    """User + system CPU of this process so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_group_cpu_seconds(pgid: int) -> float | None:
    """User + system CPU of the live processes of group ``pgid`` and of the children they have
    reaped (Linux ``/proc``; None elsewhere)."""
    if not os.path.isdir("/proc"):
        return None
    ticks = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, ... utime at 11
                    ticks += sum(int(value) for value in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float | None:
    """CPU time every core has spent busy since boot (Linux ``/proc/stat``; None elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds used during a run."""

    client_s: float
    """This process (the client; the embedded engine too, in its row)."""
    server_s: float | None
    """The server's processes (None: unknown, or the server runs in this process)."""
    others_s: float | None
    """Everything else on the machine: other people's work, which slows both clients."""


class CpuMeter:
    """Reads CPU use around a run: ``before = meter.read()`` ... ``meter.since(before)``."""

    def __init__(self, server_pgid: int | None = None):
        self.server_pgid = server_pgid

    def read(self) -> tuple[float, float | None, float | None]:
        server = process_group_cpu_seconds(self.server_pgid) if self.server_pgid else None
        return cpu_seconds(), server, machine_cpu_seconds()

    def since(self, before: tuple[float, float | None, float | None]) -> CpuUse:
        (client, server, machine), (client0, server0, machine0) = self.read(), before
        server_s = server - server0 if server is not None and server0 is not None else None
        others = None
        if machine is not None and machine0 is not None:
            others = max(0.0, machine - machine0 - (client - client0) - (server_s or 0.0))
        return CpuUse(client - client0, server_s, others)


@dataclass(frozen=True)
class CallTiming:
    """One generation call as a client saw it."""

    rid: str
    start: float
    end: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens the server took from its prefix cache, where it says (SGLang's ``cached_tokens``)."""
    server_s: float | None = None
    """The call's latency inside the server, where it says (SGLang's ``e2e_latency``)."""

    @classmethod
    def of(cls, rid: str, start: float, prompt_tokens: int, output_tokens: int, meta: dict[str, Any]) -> CallTiming:
        """A call that ends now; ``meta`` is SGLang's ``meta_info`` (or anything else: then nothing is read)."""
        cached, server = meta.get("cached_tokens"), meta.get("e2e_latency")
        return cls(rid, start, time.perf_counter(), prompt_tokens, output_tokens,
                   cached if isinstance(cached, int) else None,
                   float(server) if isinstance(server, (int, float)) else None)  # fmt: skip


class TimedEngine:
    """An engine that notes every ``generate`` call in ``calls``; everything else is the wrapped engine's."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.calls: list[CallTiming] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        start = time.perf_counter()
        generation = await self.engine.generate(input_ids, sampling, rid)
        self.calls.append(CallTiming.of(rid, start, len(input_ids), len(generation.output_ids), generation.meta))
        return generation


@dataclass(frozen=True)
class Call:
    """One generation call to replay: its input and how many tokens it produced."""

    input_ids: list[int]
    output_tokens: int


def replay_calls(prompt_ids: list[int], response_ids: list[int], loss_mask: list[int]) -> list[Call]:
    """The generation calls behind one trajectory, in order: one per run of generated tokens
    (``loss_mask`` 1), its input everything before that run."""
    calls, i = [], 0
    while i < len(loss_mask):
        if not loss_mask[i]:
            i += 1
            continue
        end = i
        while end < len(loss_mask) and loss_mask[end]:
            end += 1
        calls.append(Call(prompt_ids + response_ids[:i], end - i))
        i = end
    return calls


@dataclass(frozen=True)
class CallProfile:
    """Where a run's wall time went, seen from its calls. By Little's law, output tokens/s =
    ``in_flight`` x ``tokens_per_call_s``: how many calls the client kept at the server, times
    how fast the server produced tokens for each."""

    in_flight: float
    """Calls in flight at the server, averaged over the run's wall time."""
    tokens_per_call_s: float
    """Output tokens per second of call latency: the server's speed per call."""
    latency_s: float
    """Mean latency of one call."""
    gap_s: float
    """Mean time between the end of a request's call and the start of its next (tools, parsing,
    rendering; 0 when no request made two calls)."""
    cached_share: float | None
    """Share of prompt tokens served from the server's prefix cache (None: the server does not say)."""
    outside_server_s: float | None
    """Mean latency of a call outside the server (HTTP, the client's event loop), where the server
    says how long the call took inside it (None: it does not)."""

    @classmethod
    def of(cls, calls: list[CallTiming], wall_s: float) -> CallProfile:
        busy = sum(c.end - c.start for c in calls)
        gaps: list[float] = []
        last_end: dict[str, float] = {}
        for call in sorted(calls, key=lambda c: c.start):
            if call.rid in last_end:
                gaps.append(call.start - last_end[call.rid])
            last_end[call.rid] = call.end
        cached = [c.cached_tokens for c in calls]
        prompt = sum(c.prompt_tokens for c in calls)
        known = calls and all(c is not None for c in cached) and prompt
        outside = [c.end - c.start - c.server_s for c in calls if c.server_s is not None]
        return cls(
            in_flight=busy / wall_s if wall_s > 0 else 0.0,
            tokens_per_call_s=sum(c.output_tokens for c in calls) / busy if busy > 0 else 0.0,
            latency_s=busy / len(calls) if calls else 0.0,
            gap_s=sum(gaps) / len(gaps) if gaps else 0.0,
            cached_share=sum(cached) / prompt if known else None,  # type: ignore[arg-type]
            outside_server_s=sum(outside) / len(outside) if calls and len(outside) == len(calls) else None,
        )


class RawClient:
    """Plain HTTP generation by token ids against one server, one ``ClientSession`` for its life
    (``async with``), as rallyrl's client keeps one: no rollout logic, no checks beyond counting
    the tokens that came back, and retries (two at most) only where a pooled connection turns out
    closed (the server's keep-alive ended while it sat idle)."""

    def __init__(self, url: str, protocol: Protocol):
        self.url, self.protocol = url.rstrip("/"), protocol
        self.model = ""  # vLLM's served model name, asked on entry
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RawClient:
        timeout = aiohttp.ClientTimeout(total=600)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)  # under uvicorn's 5 s
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        if self.protocol == "vllm":
            async with self._session.get(f"{self.url}/v1/models") as response:
                self.model = (await response.json())["data"][0]["id"]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _payload(self, call: Call) -> tuple[str, bytes]:
        if self.protocol == "vllm":
            body: dict[str, Any] = {
                "model": self.model, "prompt": call.input_ids, "max_tokens": call.output_tokens, "temperature": 1.0,
                "top_p": 1.0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "skip_special_tokens": False, "add_special_tokens": False,
            }  # fmt: skip
            return f"{self.url}/v1/completions", orjson.dumps(body)
        sampling = {"max_new_tokens": call.output_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                    "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True}  # fmt: skip
        body = {"input_ids": call.input_ids, "sampling_params": sampling, "return_logprob": True, "stream": False}
        return f"{self.url}/generate", orjson.dumps(body)

    async def generate(self, call: Call, rid: str) -> CallTiming:
        """Send one call; its timing, with the tokens that came back."""
        assert self._session is not None, "enter the client with `async with` first"
        url, data = self._payload(call)
        start = time.perf_counter()
        for attempt in range(3):
            try:
                async with self._session.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
                    raw = await response.read()
                break
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):  # a stale keep-alive connection
                if attempt == 2:
                    raise
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {raw[:300]!r}")
        body = orjson.loads(raw)
        if self.protocol == "vllm":
            return CallTiming.of(rid, start, len(call.input_ids), len(body["choices"][0]["token_ids"]), {})
        return CallTiming.of(rid, start, len(call.input_ids), len(body["output_ids"]), body["meta_info"])

    async def replay(self, chains: list[list[Call]], concurrency: int) -> list[CallTiming]:
        """Every chain's calls one after another, ``concurrency`` chains at a time (as rallyrl keeps
        ``max_concurrency`` requests in flight), with nothing between a chain's calls."""
        semaphore = asyncio.Semaphore(concurrency)
        timings: list[CallTiming] = []

        async def chain(index: int, calls: list[Call]) -> None:
            async with semaphore:
                for call in calls:
                    timings.append(await self.generate(call, f"raw-{index}"))

        await asyncio.gather(*(chain(i, calls) for i, calls in enumerate(chains)))
        return timings

    async def flush_cache(self) -> None:
        """Empty the server's prefix cache (``/flush_cache``; vLLM: ``/reset_prefix_cache``), so the next
        run finds nothing of the last one's; retried while the server still holds a finished request."""
        assert self._session is not None, "enter the client with `async with` first"
        path = "/reset_prefix_cache" if self.protocol == "vllm" else "/flush_cache"
        for _ in range(50):
            async with self._session.post(f"{self.url}{path}") as response:
                text = await response.text()
                if response.status == 200 and '"success":false' not in text.replace(" ", ""):
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.url}{path} kept refusing: {text[:300]}")
