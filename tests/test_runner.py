"""RolloutRunner: fan-out, ordering, JSONL streaming, summaries and cancellation."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from conftest import ScriptedEngine, call, random_delay

from data.schema import Record
from rollout.request import validate_trajectory
from rollout.runner import RolloutRunner


def records(count: int) -> list[Record]:
    return [
        Record(prompt=[{"role": "user", "content": f"question {i}"}], data_source="test", ground_truth=str(i))
        for i in range(count)
    ]


def answer_script(turn: int, prompt: str, rid: str) -> str:
    """Turn 0 calls the tool; turn 1 answers the question's number, right for even samples."""
    question = int(prompt.split("question ")[1].split("<")[0])
    sample = int(rid.rsplit("-", 1)[1])
    return call("echo", text="ok") if turn == 0 else f"\\boxed{{{question if sample % 2 == 0 else -1}}}"


async def test_results_come_back_in_prompt_and_sample_order_whatever_finishes_first(chat, tool, tmp_path):
    engine = ScriptedEngine(chat, answer_script, delay=random_delay(0))
    runner = RolloutRunner(engine, chat, {"echo": tool}, max_concurrency=7, progress=False)
    result = await runner.run(records(10), samples_per_prompt=3, out_path=tmp_path / "out.jsonl")
    assert [(r.prompt_index, r.sample_index) for r in result.requests] == [(p, s) for p in range(10) for s in range(3)]
    lines = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    finishing_order = [(line["prompt_index"], line["sample_index"]) for line in lines]
    assert sorted(finishing_order) == [(p, s) for p in range(10) for s in range(3)]
    assert finishing_order != sorted(finishing_order)  # the file is written as requests finish


async def test_every_jsonl_line_is_a_valid_trajectory(chat, tool, tmp_path):
    engine = ScriptedEngine(chat, answer_script)
    runner = RolloutRunner(engine, chat, {"echo": tool}, progress=False)
    await runner.run(records(4), samples_per_prompt=2, out_path=tmp_path / "out.jsonl")
    for line in (tmp_path / "out.jsonl").read_bytes().splitlines():
        validate_trajectory(orjson.loads(line))


async def test_concurrency_stays_under_the_bound(chat, tool):
    engine = ScriptedEngine(chat, lambda t, p, r: call("echo", text="x", sleep=0.02) if t == 0 else "done")
    runner = RolloutRunner(engine, chat, {"echo": tool}, max_concurrency=4, progress=False)
    await runner.run(records(6), samples_per_prompt=3)
    assert tool.max_in_flight == 4


async def test_summary_counts_accuracy_pass_at_n_turns_and_tool_calls(chat, tool):
    engine = ScriptedEngine(chat, answer_script)
    runner = RolloutRunner(engine, chat, {"echo": tool}, progress=False)
    summary = (await runner.run(records(5), samples_per_prompt=2)).summary
    assert summary.trajectories == 10 and summary.prompts == 5
    assert summary.accuracy == 0.5  # even samples are right
    assert summary.pass_at_n == 1.0
    assert summary.turns == 2 and summary.tool_calls == 1
    assert summary.finish_reasons == {"stop": 10}
    assert summary.consistency_failures == 0
    assert summary.generated_tokens > 0


async def test_cancelled_run_releases_every_tool_and_keeps_finished_lines(chat, tool, tmp_path):
    def script(turn: int, prompt: str, rid: str) -> str:
        slow = int(rid.split("-")[1]) >= 2  # prompts 2.. sit in a long tool call
        return call("echo", text="x", sleep=30 if slow else 0) if turn == 0 else "done"

    runner = RolloutRunner(ScriptedEngine(chat, script), chat, {"echo": tool}, progress=False)
    task = asyncio.create_task(runner.run(records(6), samples_per_prompt=1, out_path=tmp_path / "out.jsonl"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tool.created == tool.released == 6
    lines = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert sorted(line["prompt_index"] for line in lines) == [0, 1]


async def test_samples_of_one_prompt_do_not_share_messages(chat, tool):
    engine = ScriptedEngine(chat, lambda t, p, r: "done")
    runner = RolloutRunner(engine, chat, {"echo": tool}, progress=False)
    result = await runner.run(records(1), samples_per_prompt=2)
    assert result.requests[0].messages is not result.requests[1].messages
    assert len(result.requests[0].messages) == 2  # user + its own answer


async def test_bad_sample_count_is_refused(chat, tool):
    runner = RolloutRunner(ScriptedEngine(chat, lambda t, p, r: "x"), chat, {"echo": tool}, progress=False)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
        await runner.run(records(1), samples_per_prompt=0)
