"""The bound: a discrete-event simulation of the simulated server with the same sampled tool
latencies and zero client cost, for an asynchronous client (each request moves on the moment
its turn or tool call ends) and for a batch-level one (every turn and every tool round waits
for the slowest request). No client can finish a workload sooner than the asynchronous bound.

The server model is the one ``benchmarks/sim_server.py`` runs in real time: a step admits
waiting requests in arrival order up to ``capacity`` running sequences, costs
``prefill_s_per_token`` per uncached prompt token of those it admits plus ``decode_step_s``
(plus ``decode_growth_s`` per running sequence), and gives every running sequence one token;
a turn of L tokens ends at the end of its L-th step. Requests arriving during a step wait for
the next; an idle server starts a step when a request arrives.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from benchmarks.workloads import Scenario


@dataclass
class BoundResult:
    makespan_s: float
    request_latency_s: list[float]
    busy_slot_s: float = 0.0
    """Sum over steps of running sequences x step time (for utilisation)."""
    steps: int = 0
    segments: list[list[tuple[str, float, float]]] = field(default_factory=list)
    """Per request: (state, start, end) of each generation ("running", queued at the server
    included) and tool call ("tool", waiting for a slot of a rate-limited tool included)."""

    def utilisation(self, capacity: int) -> float:
        return self.busy_slot_s / (capacity * self.makespan_s) if self.makespan_s > 0 else 0.0


class _ServerModel:
    """The step loop, advanced by ``run_until_idle`` from whatever has arrived."""

    def __init__(self, scenario: Scenario):
        w = scenario.workload
        self.scenario = scenario
        self.capacity, self.length = w.capacity, w.tokens_per_turn
        self.t = 0.0
        self.step = 0
        self.arrivals: list[tuple[float, int, int, int]] = []  # (time, order, request, turn)
        self.order = 0
        self.waiting: deque[tuple[int, int]] = deque()
        self.finishing: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.running = 0
        self.busy_slot_s = 0.0

    def arrive(self, t: float, request: int, turn: int) -> None:
        heapq.heappush(self.arrivals, (t, self.order, request, turn))
        self.order += 1

    def next_step(self) -> tuple[float, list[tuple[int, int]]] | None:
        """Run one step; returns its end time and the (request, turn) pairs it finished, or None
        when nothing is running, waiting or due to arrive."""
        w = self.scenario.workload
        if not self.running and not self.waiting:
            if not self.arrivals:
                return None
            self.t = max(self.t, self.arrivals[0][0])  # idle until the next arrival
        while self.arrivals and self.arrivals[0][0] <= self.t:
            _, _, request, turn = heapq.heappop(self.arrivals)
            self.waiting.append((request, turn))
        prefill_tokens = 0
        while self.waiting and self.running < self.capacity:
            request, turn = self.waiting.popleft()
            prefill_tokens += self.scenario.new_tokens(turn)
            self.finishing[self.step + self.length - 1].append((request, turn))
            self.running += 1
        duration = w.prefill_s_per_token * prefill_tokens + w.decode_step_s + w.decode_growth_s * self.running
        self.busy_slot_s += self.running * duration
        self.t += duration
        finished = self.finishing.pop(self.step, [])
        self.running -= len(finished)
        self.step += 1
        return self.t, finished


class _ToolSlots:
    """Tool executions in arrival order under an optional limit of M at once."""

    def __init__(self, limit: int | None):
        self.free: list[float] = [0.0] * limit if limit else []

    def run(self, arrival: float, latency: float) -> tuple[float, float]:
        if not self.free:
            return arrival, arrival + latency
        start = max(arrival, heapq.heappop(self.free))
        heapq.heappush(self.free, start + latency)
        return start, start + latency


def asynchronous_bound(scenario: Scenario, keep_segments: bool = False) -> BoundResult:
    """Each request's next turn arrives the moment its tool call ends."""
    w, latencies = scenario.workload, scenario.latencies
    server, tools = _ServerModel(scenario), _ToolSlots(w.tool_max_concurrent)
    started = np.zeros((w.requests, w.turns))
    for request in range(w.requests):
        server.arrive(0.0, request, 0)
    done = np.zeros(w.requests)
    segments: list[list[tuple[str, float, float]]] = [[] for _ in range(w.requests)] if keep_segments else []
    remaining = w.requests
    while remaining:
        result = server.next_step()
        assert result is not None, "the simulation ran dry with requests left"
        end, finished = result
        for request, turn in finished:
            if keep_segments:
                segments[request].append(("running", started[request, turn], end))
            if turn == w.turns - 1:
                done[request] = end
                remaining -= 1
                continue
            _, tool_end = tools.run(end, float(latencies[request, turn]))
            if keep_segments:  # from the call, waiting for a slot of a rate-limited tool included
                segments[request].append(("tool", end, tool_end))
            started[request, turn + 1] = tool_end
            server.arrive(tool_end, request, turn + 1)
    makespan = float(done.max()) if w.requests else 0.0
    return BoundResult(makespan, done.tolist(), server.busy_slot_s, server.step, segments)


def batch_level_bound(scenario: Scenario, keep_segments: bool = False) -> BoundResult:
    """Every turn starts for all requests together once the slowest tool call of the last round
    has ended; every tool round starts once the slowest generation has ended."""
    w, latencies = scenario.workload, scenario.latencies
    server = _ServerModel(scenario)
    segments: list[list[tuple[str, float, float]]] = [[] for _ in range(w.requests)] if keep_segments else []
    round_start = 0.0
    for turn in range(w.turns):
        for request in range(w.requests):
            server.arrive(round_start, request, turn)
        ends = np.zeros(w.requests)
        pending = w.requests
        while pending:
            end, finished = server.next_step()  # type: ignore[misc]
            for request, _ in finished:
                ends[request] = end
                if keep_segments:
                    segments[request].append(("running", round_start, end))
            pending -= len(finished)
        generated = float(ends.max())
        if turn == w.turns - 1:
            return BoundResult(generated, ends.tolist(), server.busy_slot_s, server.step, segments)
        tools = _ToolSlots(w.tool_max_concurrent)
        tool_ends = []
        for request in range(w.requests):
            _, tool_end = tools.run(generated, float(latencies[request, turn]))
            tool_ends.append(tool_end)
            if keep_segments:
                segments[request].append(("tool", generated, tool_end))
        round_start = max(tool_ends)
        server.t = max(server.t, round_start)
    return BoundResult(0.0, [], server.busy_slot_s, server.step, segments)
