"""A simulated SGLang server: SGLang's ``/generate`` request and response shapes over aiohttp on
loopback, no model, and a continuous-batching latency model run in real time.

    python -m benchmarks.sim_server --config scenario.json [--port P]

The model (the one ``benchmarks/bound.py`` simulates): each step admits waiting requests in
arrival order while fewer than ``capacity`` run, costs ``prefill_s_per_token`` per uncached
prompt token of those admitted plus ``decode_step_s`` (plus ``decode_growth_s`` per running
sequence), and gives each running sequence one token; a turn of L tokens is answered at the
end of its L-th step. Requests arriving during a step wait for the next.

Output ids are synthetic but consistent: a turn before the request's last is ``tool_turn_ids``
(text ending in a ``<tool_call>`` and the stop token), the last is ``final_ids``. The server
knows a request's turn from the tool responses in its prompt, and its cached prefix from the
previous turn of the same conversation (the rid before ``#``). A request may send ``text``
instead of ``input_ids`` (the bare client): the answer's ``text`` is always filled in (the stop
token trimmed, as SGLang does), and the scenario's token counts stand in for a tokenizer.

Steps keep to their schedule: a step that starts late (the process did not get the CPU in
time) still ends when it was due, if it can, and its lateness is recorded, so that a server
starved of CPU is told apart from a slow client (``GET /sim_stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiohttp import web


@dataclass
class _Turn:
    future: asyncio.Future[None]
    length: int
    new_tokens: int


class SimServer:
    def __init__(self, config: dict[str, Any]):
        self.capacity: int = config["capacity"]
        self.decode_step_s: float = config["decode_step_s"]
        self.decode_growth_s: float = config.get("decode_growth_s", 0.0)
        self.prefill_s_per_token: float = config.get("prefill_s_per_token", 0.0)
        self.turns: int = config["turns"]
        self.tool_turn_ids: list[int] = config["tool_turn_ids"]
        self.final_ids: list[int] = config["final_ids"]
        self.tool_response_id: int = config["tool_response_id"]
        self.texts = {"tool": config.get("tool_turn_text", ""), "final": config.get("final_text", "")}
        self.prompt_tokens: int = config.get("prompt_tokens", 0)
        self.delta_tokens: int = config.get("delta_tokens", 0)
        self._triples = {
            "tool": [[-0.1, t, None] for t in self.tool_turn_ids],
            "final": [[-0.1, t, None] for t in self.final_ids],
        }
        self.waiting: deque[_Turn] = deque()
        self.finishing: dict[int, list[_Turn]] = defaultdict(list)
        self.running = 0
        self.step = 0
        self.cached: dict[str, int] = {}  # conversation -> tokens in its cache after its last turn
        self.lateness: list[float] = []
        self.busy_slot_s = 0.0
        self.requests = 0
        self.max_waiting = 0
        self.first_arrival: float | None = None
        self.last_answer: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/sim_stats", self.stats)
        app.router.add_post("/abort_request", self.health)
        app.router.add_post("/flush_cache", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "sim", "is_generation": True, "weight_version": "default"})

    async def generate(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid: str = body.get("rid") or ""
        if "input_ids" in body:
            prompt_tokens = len(body["input_ids"])
            tool_turns_before = body["input_ids"].count(self.tool_response_id)
        else:  # text in (the bare client): the scenario's token counts stand in for a tokenizer
            tool_turns_before = body["text"].count("<tool_response>")
            prompt_tokens = self.prompt_tokens + tool_turns_before * (len(self.tool_turn_ids) + self.delta_tokens)
        last = tool_turns_before >= self.turns - 1
        kind = "final" if last else "tool"
        output = self.final_ids if last else self.tool_turn_ids
        max_new = (body.get("sampling_params") or {}).get("max_new_tokens", len(output))
        length = min(len(output), max_new)
        conversation = rid.split("#", 1)[0]
        cached = self.cached.get(conversation, 0)
        new_tokens = prompt_tokens - cached if 0 < cached <= prompt_tokens else prompt_tokens
        self.cached[conversation] = prompt_tokens + length
        now = time.monotonic()
        if self.first_arrival is None:
            self.first_arrival = now
        turn = _Turn(asyncio.get_running_loop().create_future(), length, new_tokens)
        self.waiting.append(turn)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        self._wake.set()
        await turn.future
        self.requests += 1
        finish = (
            {"type": "stop", "matched": output[-1]} if length == len(output) else {"type": "length", "length": length}
        )
        text = self.texts[kind] if length == len(output) else ""  # SGLang trims the matched stop token
        response = {
            "text": text,
            "output_ids": output[:length],
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": prompt_tokens,
                "weight_version": "default",
                "output_token_logprobs": self._triples[kind][:length],
                "completion_tokens": length,
                "cached_tokens": prompt_tokens - new_tokens,
            },
        }
        return web.Response(body=orjson.dumps(response), content_type="application/json")

    async def _loop(self) -> None:
        """The step loop; steps are scheduled back to back from when work arrives."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
            self.lateness.append(max(loop.time() - due, 0.0))
            prefill_tokens = 0
            while self.waiting and self.running < self.capacity:
                turn = self.waiting.popleft()
                prefill_tokens += turn.new_tokens
                self.finishing[self.step + turn.length - 1].append(turn)
                self.running += 1
            duration = (
                self.prefill_s_per_token * prefill_tokens + self.decode_step_s + self.decode_growth_s * self.running
            )
            self.busy_slot_s += self.running * duration
            due += duration
            delay = due - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            finished = self.finishing.pop(self.step, [])
            self.running -= len(finished)
            self.step += 1
            for turn in finished:
                turn.future.set_result(None)
            if finished:
                self.last_answer = time.monotonic()

    async def stats(self, request: web.Request) -> web.Response:
        lateness = np.array(self.lateness or [0.0])
        return web.json_response(
            {
                "steps": self.step,
                "requests": self.requests,
                "busy_slot_s": self.busy_slot_s,
                "max_waiting": self.max_waiting,
                "lateness_p50_ms": float(np.percentile(lateness, 50) * 1e3),
                "lateness_p99_ms": float(np.percentile(lateness, 99) * 1e3),
                "lateness_max_ms": float(lateness.max() * 1e3),
                "steps_late_over_1ms": int((lateness > 1e-3).sum()),
                "cpu_s": time.process_time(),
                "active_s": (self.last_answer - self.first_arrival) if self.first_arrival and self.last_answer else 0.0,
                "first_arrival": self.first_arrival,
                "last_answer": self.last_answer,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="JSON of the server model (Scenario.server_config)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = SimServer(orjson.loads(args.config.read_bytes()))

    async def serve() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, backlog=8192)
        await site.start()
        print(f"ready http://{args.host}:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    raise_fd_limit()
    asyncio.run(serve())


def raise_fd_limit() -> None:
    """Thousands of requests in flight need as many sockets: lift the soft limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    main()
