"""The bare client: the simplest correct trajectory-level agent loop, the yardstick of rallyrl's
client CPU per turn.

Raw aiohttp against ``/generate`` with text in and text out: the conversation is one ChatML
string built with f-strings (no chat template, no tokenizer, no token ids, no logprobs, no
checks), each request its own coroutine that moves on as soon as its own turn or tool call
ends, on the same simulated server and the same tool (instances created and released) as
rallyrl. ``tests/test_bench.py`` checks that its conversations are exactly what the chat
template renders, so it is a correct client, only a bare one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import aiohttp

from benchmarks.sim_tools import SimTool
from data.schema import Record


def system_block(system: str, tools: list[dict[str, Any]]) -> str:
    """The embedded model's ChatML system turn with its tool schemas, written out by hand."""
    schemas = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
    return (
        f"<|im_start|>system\n{system}\n\n# Tools\n<tools>\n{schemas}</tools>\n"
        'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    )


def tool_call_of(text: str) -> dict[str, Any] | None:
    """The first ``<tool_call>{json}</tool_call>`` of an answer, or None."""
    start = text.find("<tool_call>")
    end = text.find("</tool_call>", start)
    if start < 0 or end < 0:
        return None
    try:
        call = json.loads(text[start + len("<tool_call>") : end])
    except ValueError:
        return None
    return call if isinstance(call, dict) else None


class BareClient:
    """Runs ``records`` through the server at ``url``; ``conversations`` holds each final text."""

    def __init__(self, url: str, tool: SimTool, max_turns: int, max_new_tokens: int, stop_token_ids: list[int]):
        self.url, self.tool, self.max_turns = f"{url}/generate", tool, max_turns
        self.sampling = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "stop_token_ids": stop_token_ids}
        self.turns_done = 0
        self.conversations: list[str] = []
        self.finished_at: list[float] = []
        self.finish_reasons: Counter[str] = Counter()

    async def run(self, records: list[Record]) -> None:
        self.conversations = [""] * len(records)
        self.finished_at = [0.0] * len(records)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(self.one(session, i, record) for i, record in enumerate(records)))

    async def one(self, session: aiohttp.ClientSession, index: int, record: Record) -> None:
        system, user = record.prompt[0]["content"], record.prompt[1]["content"]
        text = system_block(system, [self.tool.schema])
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        instance = await self.tool.create(None, **record.tools_kwargs[self.tool.name]["create_kwargs"])
        try:
            for turn in range(self.max_turns):
                body = {"text": text, "sampling_params": self.sampling, "rid": f"bare-{index}#{turn}"}
                async with session.post(self.url, json=body) as response:
                    answer = await response.json()
                self.turns_done += 1
                text += answer["text"]
                call = tool_call_of(answer["text"])
                finish = answer["meta_info"]["finish_reason"]["type"]
                if finish != "stop" or call is None or turn + 1 == self.max_turns:
                    break
                result = await self.tool.execute(instance, call.get("arguments") or {})
                text += f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result.text}\n</tool_response><|im_end|>\n"
                text += "<|im_start|>assistant\n"
        finally:
            await self.tool.release(instance)
        self.conversations[index] = text
        self.finished_at[index] = time.monotonic()
        self.finish_reasons[finish if finish != "stop" or call is None else "max_turns"] += 1
