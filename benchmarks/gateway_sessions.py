"""The client process of ``benchmarks/gateway_overhead.py``'s (b): many gateway sessions held open
while the gateway's memory is read.

    python -m benchmarks.gateway_sessions URL SESSIONS RECORDS
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp

from data.agents import calc_openai
from data.synthetic import make_calc_records


async def drive_sessions(url: str, count: int, records: int) -> None:
    """The client process: open ``count`` sessions, make each one's two calls as the calc agent does,
    print ``ready``, wait for a line on stdin, finish them all, print ``done``."""
    tools = [calc_openai.CALCULATOR]
    prompts = [r.prompt for r in make_calc_records(records)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as http:

        async def session(i: int) -> str:
            async with http.post(f"{url}/sessions", json={"session_id": f"r{i % records}-s{i}"}) as response:
                sid = (await response.json())["session_id"]
            messages: list[dict[str, Any]] = [dict(m) for m in prompts[i % records]]
            for _ in range(2):
                body = {"model": "m", "messages": messages, "tools": tools}
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as response:
                    message = (await response.json())["choices"][0]["message"]
                messages.append(message)
                for call in message.get("tool_calls") or []:
                    result = calc_openai.calculator(call["function"]["arguments"])
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            return sid

        sids = await asyncio.gather(*(session(i) for i in range(count)))
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await asyncio.gather(*(http.post(f"{url}/sessions/{sid}/finish") for sid in sids))
        print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(drive_sessions(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
