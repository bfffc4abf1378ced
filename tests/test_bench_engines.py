"""``benchmarks/engines.py``'s machinery on tiny sizes, on the embedded engine and an in-process
``rallyrl serve`` (the real engines are the benchmark's business): the calls it replays are the
calls rallyrl made, its report is well formed, and a run against a server that stopped answering
ends at its deadline. The figures themselves are not checked."""

from __future__ import annotations

import asyncio
import io
import time

import orjson
import pytest
from rich.console import Console

from benchmarks import engines
from benchmarks.engine_clients import Call, TimedEngine, replay_calls
from benchmarks.engines import Rollouts, Row, Workload, bench_embedded, bench_server
from benchmarks.engines_report import breakdown, results_table
from benchmarks.waits import WaitTimeout
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.local import LocalEngine, LocalEngineConfig
from tests.conftest import serving

TINY = Workload(prompts=4, samples_per_prompt=2, concurrency=8, warmup_prompts=2)


def embedded_engine() -> LocalEngine:
    return LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(max_batch_size=8, device="cpu", seed=0))


def rendered(*tables) -> str:
    console = Console(file=io.StringIO(), width=200)
    for table in tables:
        console.print(table)
    return console.file.getvalue()


class RecordingEngine(TimedEngine):
    """Also keeps each request's calls as the engine received them."""

    def __init__(self, engine):
        super().__init__(engine)
        self.received: dict[str, list[Call]] = {}

    async def generate(self, input_ids, sampling, rid):
        generation = await super().generate(input_ids, sampling, rid)
        self.received.setdefault(rid, []).append(Call(list(input_ids), len(generation.output_ids)))
        return generation


def as_tuples(chains: list[list[Call]]) -> list[tuple]:
    return sorted(tuple((tuple(call.input_ids), call.output_tokens) for call in chain) for chain in chains)


def test_a_trajectory_replays_as_one_call_per_run_of_generated_tokens():
    calls = replay_calls([1, 2], [5, 6, 0, 0, 7, 8, 9, 0], [1, 1, 0, 0, 1, 1, 1, 0])
    assert calls == [Call([1, 2], 2), Call([1, 2, 5, 6, 0, 0], 3)]


async def test_the_calls_read_from_trajectories_are_the_calls_rallyrl_made(tmp_path):
    rollouts = Rollouts(TINY, tmp_path)
    async with embedded_engine() as engine:
        recording = RecordingEngine(engine)
        run = await rollouts.run(recording, 0)
    assert as_tuples(rollouts.chains) == as_tuples(list(recording.received.values()))
    assert any(len(chain) > 1 for chain in rollouts.chains)  # multi-turn: tool calls went through
    assert run.output_tokens == sum(call.output_tokens for chain in rollouts.chains for call in chain)
    assert run.calls == sum(map(len, rollouts.chains)) and run.errors == 0


async def test_raw_and_rallyrl_ask_an_in_process_server_for_the_same_tokens(tmp_path):
    async with embedded_engine() as engine, serving(engine) as url:
        row = await bench_server(Row("serve"), url, "sglang", TINY, 2, tmp_path)
    rallyrl, raw = row.of("rallyrl"), row.of("raw")
    assert [r.repeat for r in row.runs] == [0, 0, 1, 1] and [r.client for r in row.runs][2:] == ["raw", "rallyrl"]
    for run in raw:  # each replays the rallyrl run before it: the same calls, the same output tokens
        assert run.output_tokens == rallyrl[run.replays].output_tokens > 0
        assert run.calls == rallyrl[run.replays].calls
    assert len(row.ratios()) == 2 and all(ratio > 0 for ratio in row.ratios())
    assert all(r.wall_s > 0 and r.profile.in_flight > 0 and r.profile.latency_s > 0 for r in row.runs)
    assert all(r.profile.outside_server_s is not None for r in row.runs)  # the server says its own latency
    assert orjson.loads(orjson.dumps(row.to_dict()))["ratios"] == row.ratios()
    table, text = breakdown(row, TINY.concurrency)
    assert "calls in flight" in rendered(results_table([row]), table) and "rallyrl/raw" in text


async def test_the_embedded_row_has_rallyrl_runs_only(tmp_path):
    row = await bench_embedded(Row("embedded"), TINY, 1, tmp_path)
    assert [r.client for r in row.runs] == ["rallyrl"] and row.ratios() == []
    assert row.startup_s > 0 and row.runs[0].tokens_per_s > 0
    assert "embedded" in rendered(results_table([row]))


def test_an_engine_without_its_virtualenv_is_skipped_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RALLYRL_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    row = engines.bench_row("vllm", TINY, 1, tmp_path)
    assert row.runs == [] and "install_engines vllm" in row.skipped
    assert "skipped" in rendered(results_table([row]))


async def test_a_run_against_a_server_that_never_answers_ends_at_its_deadline_naming_it(tmp_path):
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # (until the client closes the connection)
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    started = time.monotonic()
    async with server:
        with pytest.raises(WaitTimeout, match=rf"serve at {url}: the rallyrl warm-up run did not finish within 1 s "
                                              r"\(--run-timeout-s\)"):  # fmt: skip
            await bench_server(Row("serve"), url, "sglang", TINY, 1, tmp_path, run_timeout_s=1.0)
    assert time.monotonic() - started < 5
