"""Per-turn client cost, piece by piece: what one assistant turn of W1 costs rallyrl's client.

    python -m benchmarks.client_overhead [--repeat 2000]

Each piece is timed alone on W1-shaped data (the embedded model's tokenizer and template, a
conversation of four turns, a 64-token output): rendering and delta tokenization of the tool
result, decoding and parsing the output, checking the call's arguments, encoding the request
and decoding the response JSON, and one HTTP round trip's client CPU against the simulated
server (its own process) with no decode time. Per-request work (the first prompt, the consistency check, the tool's
create and release) is divided by the workload's four turns. The sum is compared with the
client CPU per turn that ``benchmarks/tool_concurrency.py`` measures on a whole W1 run; the
difference is the event loop, task switching, tracing and garbage collection.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from benchmarks.tool_concurrency import sim_server
from benchmarks.workloads import TOOL_RESULT, W1, Scenario
from rollout.engines.base import SamplingParams
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.engines.sglang_protocol import generate_payload, parse_generation
from rollout.parsers import get_parser


def per_call_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    started = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - started) / repeat * 1e6


async def http_round_trip_us(url: str, input_ids: list[int], sampling: SamplingParams, repeat: int) -> float:
    """Client CPU of one ``SGLangHTTPEngine.generate``, 64 in flight, against the simulated
    server in its own process with no decode time (so only the client's CPU is counted)."""
    batch = 64
    async with SGLangHTTPEngine(url) as engine:
        await asyncio.gather(*(engine.generate(input_ids, sampling, f"warm-{i}") for i in range(batch)))
        rounds = max(repeat // batch, 1)
        started = time.process_time()
        for round_ in range(rounds):
            await asyncio.gather(*(engine.generate(input_ids, sampling, f"r{round_}-{i}") for i in range(batch)))
        return (time.process_time() - started) / (rounds * batch) * 1e6


def breakdown(repeat: int) -> list[tuple[str, float, str]]:
    """(piece, microseconds per turn, what it covers)."""
    scenario = Scenario.build(W1)
    chat, tool, turns = scenario.chat, scenario.tool, W1.turns
    parser = get_parser("qwen25")
    record = scenario.records()[0]
    messages = list(record.prompt)
    output = scenario.tool_turn_ids
    text = chat.assistant_text(output)
    conversation = [*messages]
    for _ in range(turns - 1):
        conversation += [{"role": "assistant", "content": text}, {"role": "tool", "content": TOOL_RESULT}]
    conversation.append({"role": "assistant", "content": chat.assistant_text(scenario.final_ids)})
    all_ids = chat.encode(chat.render(conversation))
    tool_message = [{"role": "tool", "content": TOOL_RESULT}]
    sampling = SamplingParams(max_new_tokens=W1.tokens_per_turn, stop_token_ids=chat.stop_token_ids)
    input_ids = all_ids[: scenario.prompt_tokens + 2 * (len(output) + scenario.delta_tokens)]
    response = orjson.dumps(
        {
            "text": text,
            "output_ids": output,
            "meta_info": {
                "id": "r#1",
                "finish_reason": {"type": "stop", "matched": output[-1]},
                "output_token_logprobs": [[-0.1, t, None] for t in output],
                "weight_version": "default",
            },
        }
    )

    async def tool_life_us() -> float:
        started = time.process_time()
        for _ in range(repeat):
            instance = await tool.create(None, latencies=[0.0])
            await tool.release(instance)
        return (time.process_time() - started) / repeat * 1e6

    instant = Scenario.build(dataclasses.replace(W1, decode_step_s=0.0, prefill_s_per_token=0.0, capacity=4096))
    with sim_server(instant) as (url, _):
        http_us = asyncio.run(http_round_trip_us(url, input_ids, sampling, repeat))

    rows = [
        ("render + tokenize tool result", per_call_us(lambda: chat.delta_ids(tool_message), repeat),
         "delta rendering of the tool message and the next generation prompt"),
        ("assistant glue", per_call_us(lambda: chat.assistant_close_ids(output), repeat), "the template's turn close"),
        ("decode output", per_call_us(lambda: chat.assistant_text(output), repeat), "64 ids to text"),
        ("parse tool call", per_call_us(lambda: parser(text), repeat), "qwen25 parser"),
        ("check arguments", per_call_us(lambda: tool.check_arguments({}), repeat), "JSON-schema validation"),
        ("encode request JSON", per_call_us(lambda: orjson.dumps(generate_payload(input_ids, sampling, "r#1")), repeat),
         f"{len(input_ids)} input ids"),
        ("decode response JSON", per_call_us(lambda: parse_generation(orjson.loads(response), "x", 0), repeat),
         "ids, logprobs, finish reason"),
        ("HTTP round trip (client)", http_us, "client CPU per /generate (aiohttp), warm connections"),
        ("first prompt / turns", per_call_us(lambda: chat.prompt_ids(messages), repeat) / turns,
         "render + tokenize the prompt once per request"),
        ("consistency check / turns", per_call_us(lambda: chat.check_consistency(conversation, all_ids), repeat // 4)
         / turns, "re-render and diff the whole conversation once per request"),
        ("tool create + release / turns", asyncio.run(tool_life_us()) / turns, "once per request"),
    ]  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    rows = breakdown(args.repeat)
    table = Table(title="client CPU per W1 turn, by piece")
    table.add_column("piece")
    table.add_column("us / turn", justify="right")
    table.add_column("what")
    for name, us, what in rows:
        table.add_row(name, f"{us:.1f}", what)
    table.add_row("sum", f"{sum(us for _, us, _ in rows):.1f}", "compare with the benchmark's CPU per turn")
    Console().print(table)


if __name__ == "__main__":
    main()
