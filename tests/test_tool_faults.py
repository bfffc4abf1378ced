"""Tools that misbehave: every fault is recorded on its request, the request ends cleanly, every
request of a batch comes back, and every successful ``create`` is released exactly once."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import orjson
import pytest
from conftest import ScriptedEngine, call

from data.schema import Record
from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState, validate_trajectory
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool, ToolError, ToolResponse, function_schema

HUGE = "a" * 5_000_000 + "b" * 5_000_000  # 10 MB of tool output

EXECUTE_MODES = ("ok", "raise", "hang", "none", "str", "dict", "huge")
"""What ``faulty(mode=...)`` does; anything but ok is a fault the request must record."""


async def _misbehave(fault: str, stage: str) -> None:
    if fault == "raise":
        raise RuntimeError(f"{stage} crashed")
    if fault == "hang":
        await asyncio.sleep(3600)
    if fault == "slow":
        await asyncio.sleep(0.3)


class FaultyTool(BaseTool):
    """``faulty(mode)``: execute does what ``mode`` says (see ``execute``); ``calc_reward`` and
    ``release`` raise, hang or are slow as configured; ``create_kwargs.refuse`` makes create fail.
    Every successful create and every release is recorded by instance id."""

    def __init__(self, name: str = "faulty", *, calc_reward: Any = "ok", release: str = "ok", create: str = "ok"):
        schema = self.default_schema()
        schema["function"]["name"] = name
        super().__init__(schema=schema)
        self.faults = {"calc_reward": calc_reward, "release": release, "create": create}
        self.created: list[str] = []
        self.released: list[str] = []
        self.executing = 0
        self.scoring = 0

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        parameters = {"type": "object", "properties": {"mode": {"type": "string"}}, "required": ["mode"]}
        return function_schema("faulty", "Misbehave on purpose.", parameters)

    async def create(self, instance_id: str | None = None, refuse: bool = False, **create_kwargs: Any) -> str:
        if refuse:
            raise ToolError(f"{self.name}: create refused for this request")
        await _misbehave(self.faults["create"], "create")
        instance_id = await super().create(instance_id, **create_kwargs)
        self.created.append(instance_id)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> Any:
        self.instance(instance_id)
        self.executing += 1
        try:
            match parameters["mode"]:
                case "raise":
                    raise RuntimeError("execute crashed")
                case "hang":
                    await asyncio.sleep(3600)
                case "none":
                    return None
                case "str":
                    return "a bare string"
                case "dict":
                    return {"text": "a dict"}
                case "huge":
                    return ToolResponse(HUGE)
                case "surrogate":  # bytes decoded with errors="surrogateescape", as a subprocess tool might
                    return ToolResponse(b"out: \xff\xfe".decode("utf-8", "surrogateescape"))
                case "bad_metrics":
                    return ToolResponse("ok", metrics={"handle": object()})
                case "cancelled":  # e.g. awaiting an inner task that something else cancelled
                    raise asyncio.CancelledError()
            return ToolResponse("ok", reward=0.5)
        finally:
            self.executing -= 1

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        fault = self.faults["calc_reward"]
        if isinstance(fault, float):
            return fault
        self.scoring += 1
        try:
            await _misbehave(fault, "calc_reward")
        finally:
            self.scoring -= 1
        return 1.0

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        self.released.append(instance_id)
        await _misbehave(self.faults["release"], "release")
        await super().release(instance_id, **release_kwargs)


def assert_balanced(*tools: FaultyTool) -> None:
    """Every successful create was released exactly once, and nothing else was released."""
    for tool in tools:
        assert len(set(tool.released)) == len(tool.released), f"{tool.name}: an instance was released twice"
        assert sorted(tool.released) == sorted(tool.created), f"{tool.name}: creates and releases differ"


FAST = RolloutConfig(tool_timeout_s=0.1, tool_reward_timeout_s=0.1, max_model_len=8192)
PROMPT = [{"role": "user", "content": "Call the tool."}]


@pytest.fixture
def chat(tokenizer):
    return ChatTokenizer(tokenizer, [FaultyTool().schema])


def calls_then_answers(mode: str):
    """A model that calls ``faulty(mode)`` once, then answers."""
    return lambda turn, prompt, rid: call("faulty", mode=mode) if turn == 0 else "done"


async def drive(
    chat, tools: list[FaultyTool], mode: str = "ok", config: RolloutConfig = FAST, limit_s: float = 10
) -> AsyncRolloutRequest:
    """One request that calls ``faulty(mode)``, then answers; it must end within ``limit_s``."""
    request = AsyncRolloutRequest("r0", 0, 0, [dict(m) for m in PROMPT])
    engine = ScriptedEngine(chat, calls_then_answers(mode))
    async with asyncio.timeout(limit_s):  # a fault must never stall the request
        await run_request(request, engine, chat, {tool.name: tool for tool in tools}, config)
    return request


def tool_texts(request: AsyncRolloutRequest) -> list[str]:
    return [m["content"] for m in request.messages if m["role"] == "tool"]


def assert_recorded(request: AsyncRolloutRequest) -> dict[str, Any]:
    """The request is completed and its JSONL record serialises and validates; the record is returned."""
    assert request.state is RequestState.COMPLETED and request.finish_reason is not None
    record = orjson.loads(orjson.dumps(request.to_record()))
    validate_trajectory(record)
    return record


# ----- execute -------------------------------------------------------------------------------


async def test_execute_that_raises_is_answered_with_an_error_and_the_request_goes_on(chat):
    tool = FaultyTool()
    request = await drive(chat, [tool], "raise")
    assert request.tool_calls[0].error == "tool faulty failed: RuntimeError: execute crashed"
    assert tool_texts(request) == ["Error: tool faulty failed: RuntimeError: execute crashed"]
    assert request.finish_reason is FinishReason.STOP and request.metrics.tool_errors == 1
    assert_recorded(request)
    assert_balanced(tool)


async def test_execute_that_hangs_times_out_and_the_request_goes_on(chat):
    tool = FaultyTool()
    request = await drive(chat, [tool], "hang")
    assert request.tool_calls[0].error == "tool faulty timed out after 0.1 s"
    assert request.tool_calls[0].latency_s < 2.0
    assert tool.executing == 0  # the hung call was cancelled, not left running
    assert request.finish_reason is FinishReason.STOP
    assert_balanced(tool)


async def test_hanging_calls_of_one_turn_time_out_together_not_one_after_another(chat):
    tool = FaultyTool()
    engine = ScriptedEngine(chat, lambda turn, p, r: call("faulty", mode="hang") * 3 if turn == 0 else "done")
    request = AsyncRolloutRequest("r0", 0, 0, [dict(m) for m in PROMPT])
    config = RolloutConfig(tool_timeout_s=0.3)
    await run_request(request, engine, chat, {"faulty": tool}, config)
    assert [c.error for c in request.tool_calls] == ["tool faulty timed out after 0.3 s"] * 3
    assert request.metrics.state_seconds["tool_calling"] < 0.9
    assert_balanced(tool)


@pytest.mark.parametrize(("mode", "type_name"), [("none", "NoneType"), ("str", "str"), ("dict", "dict")])
async def test_execute_returning_the_wrong_type_is_an_error_naming_the_type(chat, mode, type_name):
    tool = FaultyTool()
    request = await drive(chat, [tool], mode)
    assert (
        request.tool_calls[0].error == f"tool faulty failed: TypeError: execute returned {type_name}, not ToolResponse"
    )
    assert request.finish_reason is FinishReason.STOP
    assert_recorded(request)
    assert_balanced(tool)


async def test_huge_output_is_cut_to_max_tool_response_chars_keeping_head_and_tail(chat):
    tool = FaultyTool()
    request = await drive(chat, [tool], "huge")
    (text,) = tool_texts(request)
    assert len(text) <= FAST.max_tool_response_chars
    assert text.startswith("a") and text.endswith("b") and "characters cut" in text
    assert request.tool_calls[0].text == text and request.tool_calls[0].error is None
    assert request.finish_reason is FinishReason.STOP
    assert len(orjson.dumps(assert_recorded(request))) < 200_000  # the 10 MB never reaches the JSONL
    assert_balanced(tool)


async def test_tool_output_with_lone_surrogates_is_recorded_and_released(chat):
    tool = FaultyTool()
    request = await drive(chat, [tool], "surrogate")
    assert_recorded(request)
    assert_balanced(tool)


# ----- create --------------------------------------------------------------------------------


async def test_create_that_fails_for_some_requests_ends_only_those_and_releases_the_rest(chat):
    first, refusing = FaultyTool("first"), FaultyTool()
    records = [
        Record(
            prompt=[{"role": "user", "content": f"question {i}"}],
            tools_kwargs={"faulty": {"create_kwargs": {"refuse": i % 2 == 1}}},
        )
        for i in range(6)
    ]
    engine = ScriptedEngine(chat, calls_then_answers("ok"))
    runner = RolloutRunner(engine, chat, {"first": first, "faulty": refusing}, FAST, progress=False)
    result = await runner.run(records, samples_per_prompt=2)
    assert [(r.prompt_index, r.sample_index) for r in result.requests] == [(p, s) for p in range(6) for s in range(2)]
    for request in result.requests:
        if request.prompt_index % 2:
            assert request.finish_reason is FinishReason.ERROR
            assert request.error == "create of tool faulty failed: ToolError: faulty: create refused for this request"
        else:
            assert request.finish_reason is FinishReason.STOP and request.error is None
        assert_recorded(request)
    assert len(first.created) == 12 and len(refusing.created) == 6
    assert_balanced(first, refusing)


async def test_create_that_hangs_ends_the_request_within_the_tool_timeouts(chat):
    tool = FaultyTool(create="hang")
    request = await drive(chat, [tool], "ok", FAST, limit_s=1.0)
    assert request.finish_reason is FinishReason.ERROR


# ----- calc_reward and release ---------------------------------------------------------------


@pytest.mark.parametrize(("fault", "error"), [("raise", "RuntimeError: calc_reward crashed"), ("hang", "TimeoutError")])
async def test_calc_reward_that_fails_scores_zero_notes_the_error_and_releases(chat, fault, error):
    tool, other = FaultyTool(calc_reward=fault), FaultyTool("other")
    request = await drive(chat, [tool, other], "ok")
    assert request.rewards.tools == {"faulty": 0.0, "other": 1.0}
    assert request.error is not None and request.error.startswith(f"calc_reward of faulty failed: {error}")
    assert request.finish_reason is FinishReason.STOP  # the conversation itself ended well
    assert request.metrics.tool_errors == 1
    assert_recorded(request)
    assert_balanced(tool, other)


async def test_calc_reward_that_returns_nan_is_an_error_not_a_reward(chat):
    tool = FaultyTool(calc_reward=float("nan"))
    request = await drive(chat, [tool], "ok")
    assert math.isfinite(request.rewards.final)
    assert "calc_reward of faulty" in (request.error or "")
    assert_recorded(request)


@pytest.mark.parametrize(("fault", "error"), [("raise", "RuntimeError: release crashed"), ("hang", "timed out")])
async def test_release_that_fails_is_noted_and_the_next_tool_is_still_released(chat, fault, error):
    failing, after = FaultyTool("first", release=fault), FaultyTool()
    request = await drive(chat, [failing, after], "ok")
    assert request.error is not None and request.error.startswith(f"release of first failed: {error}")
    assert request.finish_reason is FinishReason.STOP
    assert after.released == after.created  # released although the first release failed
    assert_recorded(request)
    assert_balanced(failing, after)


# ----- batches -------------------------------------------------------------------------------


def mode_records(modes: tuple[str, ...] | list[str]) -> list[Record]:
    return [Record(prompt=[{"role": "user", "content": f"mode={mode};"}]) for mode in modes]


def mode_from_prompt(turn: int, prompt: str, rid: str) -> str:
    """Turn 0 calls ``faulty`` with the mode its prompt names; turn 1 answers."""
    return call("faulty", mode=prompt.split("mode=")[1].split(";")[0]) if turn == 0 else "done"


async def test_every_request_of_a_batch_comes_back_whatever_its_tool_does(chat, tmp_path):
    tool = FaultyTool()
    runner = RolloutRunner(ScriptedEngine(chat, mode_from_prompt), chat, {"faulty": tool}, FAST, max_concurrency=4,
                           progress=False)  # fmt: skip
    async with asyncio.timeout(30):
        result = await runner.run(mode_records(EXECUTE_MODES), samples_per_prompt=2, out_path=tmp_path / "out.jsonl")
    assert [(r.prompt_index, r.sample_index) for r in result.requests] == [
        (p, s) for p in range(len(EXECUTE_MODES)) for s in range(2)
    ]
    for request in result.requests:
        mode = EXECUTE_MODES[request.prompt_index]
        failed = request.tool_calls[0].error is not None
        assert failed == (mode not in ("ok", "huge")), mode
        assert request.finish_reason is FinishReason.STOP, mode
    lines = (tmp_path / "out.jsonl").read_bytes().splitlines()
    assert len(lines) == 2 * len(EXECUTE_MODES)
    for line in lines:
        validate_trajectory(orjson.loads(line))
    assert sum(r.metrics.tool_errors for r in result.requests) == 2 * (len(EXECUTE_MODES) - 2)
    assert result.summary.tool_errors == pytest.approx((len(EXECUTE_MODES) - 2) / len(EXECUTE_MODES))  # per trajectory
    assert_balanced(tool)


async def test_a_tool_metric_that_is_not_json_does_not_lose_the_batch(chat, tmp_path):
    tool = FaultyTool()
    runner = RolloutRunner(ScriptedEngine(chat, mode_from_prompt), chat, {"faulty": tool}, FAST, progress=False)
    result = await runner.run(mode_records(["ok", "bad_metrics", "ok"]), out_path=tmp_path / "out.jsonl")
    assert len(result.requests) == 3
    assert len((tmp_path / "out.jsonl").read_bytes().splitlines()) == 3


async def test_a_tool_raising_cancelled_error_by_itself_does_not_lose_the_batch(chat):
    tool = FaultyTool()
    runner = RolloutRunner(ScriptedEngine(chat, mode_from_prompt), chat, {"faulty": tool}, FAST, progress=False)
    result = await runner.run(mode_records(["ok", "cancelled", "ok"]))
    assert [r.tool_calls[0].error is not None for r in result.requests] == [False, True, False]


# ----- cancellation --------------------------------------------------------------------------


async def cancel_when(runner_task: asyncio.Task, ready) -> None:
    """Cancel ``runner_task`` as soon as ``ready()`` holds, and wait for it to end."""
    async with asyncio.timeout(10):
        while not ready():
            await asyncio.sleep(0.01)
    runner_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner_task


async def test_cancelled_runner_releases_every_instance_while_tools_hang(chat, tmp_path):
    tool, other = FaultyTool(), FaultyTool("other")
    config = RolloutConfig(tool_timeout_s=3600)
    runner = RolloutRunner(ScriptedEngine(chat, mode_from_prompt), chat, {"faulty": tool, "other": other}, config,
                           max_concurrency=4, progress=False)  # fmt: skip
    task = asyncio.create_task(runner.run(mode_records(["hang"] * 8), out_path=tmp_path / "out.jsonl"))
    await cancel_when(task, lambda: tool.executing == 4)
    assert len(tool.created) == 4  # the other four never started
    assert tool.executing == 0
    assert_balanced(tool, other)


async def test_cancelled_runner_releases_every_instance_while_calc_reward_hangs(chat):
    tool = FaultyTool(calc_reward="hang")
    config = RolloutConfig(tool_reward_timeout_s=3600)
    runner = RolloutRunner(ScriptedEngine(chat, mode_from_prompt), chat, {"faulty": tool}, config, progress=False)
    task = asyncio.create_task(runner.run(mode_records(["ok"] * 3)))
    await cancel_when(task, lambda: tool.scoring == 3)
    assert_balanced(tool)


async def test_cancelled_runner_releases_later_tools_while_a_release_is_slow(chat):
    slow, after = FaultyTool("first", release="slow"), FaultyTool()
    config = RolloutConfig(tool_reward_timeout_s=3600)  # the cancellation, not a timeout, interrupts the release
    runner = RolloutRunner(ScriptedEngine(chat, mode_from_prompt), chat, {"first": slow, "faulty": after}, config,
                           progress=False)  # fmt: skip
    task = asyncio.create_task(runner.run(mode_records(["ok"] * 3)))
    await cancel_when(task, lambda: len(slow.released) == 3)
    assert_balanced(slow, after)
