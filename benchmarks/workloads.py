"""The benchmark's workloads (W1, W2, W3) and the conversation every request of one has.

A workload fixes the server model (capacity, prefill and decode cost), the conversation
(assistant turns, tokens per turn) and the tool (latency model, rate limit). ``Scenario``
turns it into token counts with the embedded model's chat template, so the simulated server,
the clients and the bound all see the same prompt, output and tool-response lengths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.sim_tools import Fixed, LatencyModel, LogNormal, SimTool
from data.schema import Record
from data.tiny_model import EMBEDDED_MODEL
from rollout.tokens import ChatTokenizer, load_tokenizer

TOOL_CALL_TEXT = '<tool_call>{"name": "wait", "arguments": {}}</tool_call>'
FINAL_TEXT = "The answer is 42."
TOOL_RESULT = "done"


@dataclass(frozen=True)
class Workload:
    """One benchmark workload; every field is part of what the three systems are compared on."""

    name: str
    requests: int
    turns: int
    """Assistant turns per request: a tool call on each turn before the last."""
    capacity: int
    """Sequences the server decodes at once (C); more wait in a FIFO queue."""
    tokens_per_turn: int = 64
    decode_step_s: float = 0.005
    decode_growth_s: float = 0.0
    """Extra decode-step time per running sequence."""
    prefill_s_per_token: float = 1e-6
    """Prefill cost per prompt token not already in the server's cache for that conversation."""
    tool_latency: LatencyModel = field(default_factory=lambda: LogNormal(0.2, 1.0))
    tool_max_concurrent: int | None = None
    """Rate limit of the tool: at most this many executions at once (None: no limit)."""
    seed: int = 0

    @property
    def tool_calls(self) -> int:
        return self.turns - 1

    def describe(self) -> str:
        tool = self.tool_latency.describe() + (
            f", at most {self.tool_max_concurrent} at once" if self.tool_max_concurrent else ""
        )
        return (
            f"{self.name}: {self.requests} requests x {self.turns} turns ({self.tool_calls} tool calls), "
            f"C={self.capacity}, {self.tokens_per_turn} tokens/turn, {self.decode_step_s * 1e3:g} ms/step; "
            f"tool {tool}"
        )

    def sample_latencies(self) -> np.ndarray:
        """Tool latencies, shape (requests, tool_calls), from the workload's seed."""
        rng = np.random.default_rng(self.seed)
        return self.tool_latency.sample(rng, (self.requests, self.tool_calls))

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["tool_latency"] = self.tool_latency.describe()
        return values


W1 = Workload("W1", requests=1024, turns=4, capacity=256, tool_latency=LogNormal(0.2, 1.0))
W2 = dataclasses.replace(W1, name="W2", tool_max_concurrent=32)
W3 = Workload("W3", requests=4096, turns=1, capacity=256, tool_latency=Fixed(0.0))
WORKLOADS = {"W1": W1, "W2": W2, "W3": W3}

QUICK = {
    "W1": dataclasses.replace(W1, requests=256, capacity=64, tokens_per_turn=48),
    "W2": dataclasses.replace(W2, requests=128, capacity=64, tokens_per_turn=48),
    "W3": dataclasses.replace(W3, requests=1024, tokens_per_turn=48),
}
"""Smaller versions that run all three workloads and all three systems in under a minute."""


@dataclass
class Scenario:
    """A workload made concrete: the chat template, the prompt of every request, the output ids of
    a tool-call turn and of the final turn, and the token counts the bound needs."""

    workload: Workload
    chat: ChatTokenizer
    tool: SimTool
    latencies: np.ndarray
    prompt_tokens: int
    tool_turn_ids: list[int]
    final_ids: list[int]
    delta_tokens: int
    """Tokens a tool turn adds to the prompt after the assistant's output: glue and tool response."""
    tool_response_id: int
    """The token that opens a tool response; the server counts them to know the turn."""

    @classmethod
    def build(cls, workload: Workload) -> Scenario:
        tool = SimTool({"max_concurrent": workload.tool_max_concurrent})
        chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [tool.schema])
        prompt = chat.prompt_ids(request_messages(0))
        tool_turn = padded(chat, TOOL_CALL_TEXT, workload.tokens_per_turn)
        final = padded(chat, FINAL_TEXT, workload.tokens_per_turn)
        delta = chat.assistant_close_ids(tool_turn) + chat.delta_ids([{"role": "tool", "content": TOOL_RESULT}])
        (tool_response_id,) = chat.encode("<tool_response>")
        return cls(
            workload=workload,
            chat=chat,
            tool=tool,
            latencies=workload.sample_latencies(),
            prompt_tokens=len(prompt),
            tool_turn_ids=tool_turn,
            final_ids=final,
            delta_tokens=len(delta),
            tool_response_id=tool_response_id,
        )

    def records(self) -> list[Record]:
        """One record per request; its tool instance gets the request's latencies."""
        return [
            Record(
                prompt=request_messages(i),
                data_source="bench",
                tools_kwargs={"wait": {"create_kwargs": {"latencies": self.latencies[i].tolist()}}},
            )
            for i in range(self.workload.requests)
        ]

    def server_config(self) -> dict[str, Any]:
        """What the simulated server needs (JSON-serialisable)."""
        w = self.workload
        return {
            "capacity": w.capacity,
            "decode_step_s": w.decode_step_s,
            "decode_growth_s": w.decode_growth_s,
            "prefill_s_per_token": w.prefill_s_per_token,
            "turns": w.turns,
            "tool_turn_ids": self.tool_turn_ids,
            "final_ids": self.final_ids,
            "tool_response_id": self.tool_response_id,
            "tool_turn_text": self.chat.assistant_text(self.tool_turn_ids),
            "final_text": self.chat.assistant_text(self.final_ids),
            "prompt_tokens": self.prompt_tokens,
            "delta_tokens": self.delta_tokens,
        }

    def new_tokens(self, turn: int) -> int:
        """Prompt tokens of ``turn`` not cached from the conversation's previous turn."""
        return self.prompt_tokens if turn == 0 else self.delta_tokens


def request_messages(index: int) -> list[dict[str, str]]:
    """Every request's prompt has the same length (its number is zero-padded)."""
    return [
        {"role": "system", "content": "You are an agent. Use the wait tool until the work is done."},
        {"role": "user", "content": f"Task {index:06d}: call wait three times, then answer."},
    ]


def padded(chat: ChatTokenizer, text: str, tokens: int) -> list[int]:
    """Token ids of exactly ``tokens`` tokens: filler, ``text``, then the stop token."""
    body = chat.encode(text)
    stop = chat.turn_close_ids[:1]
    room = tokens - len(body) - len(stop)
    if room < 0:
        raise ValueError(f"{tokens} tokens per turn cannot hold {text!r} ({len(body) + len(stop)} tokens)")
    filler = chat.encode(("thinking " * tokens)[:room])
    return filler + body + stop
