"""The request state machine, driven by a scripted engine and real tools."""

from __future__ import annotations

import asyncio

import pytest
from conftest import CountingTool, ScriptedEngine, call

from rollout.loop import RolloutConfig, run_request, truncate_middle
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


def new_request(rid: str = "r0", ground_truth: str | None = None) -> AsyncRolloutRequest:
    return AsyncRolloutRequest(rid, 0, 0, [dict(m) for m in PROMPT], ground_truth=ground_truth)


async def drive(chat, tool, turns, config=None, request=None, **engine_kwargs):
    """Run one request whose assistant turns are ``turns`` (strings or exceptions, in order)."""
    engine = ScriptedEngine(chat, lambda i, prompt, rid: turns[min(i, len(turns) - 1)], **engine_kwargs)
    request = request or new_request()
    await run_request(request, engine, chat, {tool.name: tool}, config or RolloutConfig())
    return request, engine


def states(request: AsyncRolloutRequest) -> list[str]:
    return [event.state.value for event in request.trace]


def tool_texts(request: AsyncRolloutRequest) -> list[str]:
    return [m["content"] for m in request.messages if m["role"] == "tool"]


async def test_answer_without_tools_stops(chat, tool):
    request, _ = await drive(chat, tool, ["hi"])
    assert request.finish_reason is FinishReason.STOP
    assert states(request) == ["pending", "running", "completed"]
    assert request.messages[-1] == {"role": "assistant", "content": "hi"}
    assert request.metrics.turns == 1


async def test_tool_call_round_trip_passes_through_tool_calling(chat, tool):
    request, _ = await drive(chat, tool, [call("echo", text="pong"), "done"])
    assert states(request) == ["pending", "running", "tool_calling", "running", "completed"]
    assert tool_texts(request) == ["pong"]
    assert request.tool_calls[0].name == "echo" and request.tool_calls[0].error is None
    assert request.rewards.step == [0.5]
    assert request.rewards.tools == {"echo": 0.25}
    assert request.finish_reason is FinishReason.STOP


async def test_calls_of_one_turn_run_concurrently(chat, tool):
    two = call("echo", text="a", sleep=0.2) + call("echo", text="b", sleep=0.2)
    request, _ = await drive(chat, tool, [two, "done"])
    assert tool.max_in_flight == 2
    assert tool_texts(request) == ["a", "b"]  # in the order the model wrote them


async def test_calls_beyond_max_parallel_calls_get_an_error(chat, tool):
    three = call("echo", text="a") + call("echo", text="b") + call("echo", text="c")
    request, _ = await drive(chat, tool, [three, "done"], RolloutConfig(max_parallel_calls=2))
    texts = tool_texts(request)
    assert texts[:2] == ["a", "b"]
    assert texts[2].startswith("Error: skipped")


async def test_malformed_json_comes_back_as_a_tool_message(chat, tool):
    request, _ = await drive(chat, tool, ['<tool_call>{"name": "echo", "arguments": {</tool_call>', "done"])
    assert tool_texts(request)[0].startswith("Error: invalid JSON in tool call")
    assert request.tool_calls[0].error is not None
    assert request.finish_reason is FinishReason.STOP


async def test_unknown_tool_comes_back_as_a_tool_message(chat, tool):
    request, _ = await drive(chat, tool, [call("search", query="x"), "done"])
    assert tool_texts(request) == ["Error: unknown tool 'search'; available tools: echo"]


async def test_arguments_that_break_the_schema_come_back_as_a_tool_message(chat, tool):
    request, _ = await drive(chat, tool, [call("echo", words="x"), "done"])
    assert tool_texts(request)[0].startswith("Error: bad arguments for echo: 'text' is a required property")


async def test_tool_exception_comes_back_as_a_tool_message(chat, tool):
    request, _ = await drive(chat, tool, [call("echo", text="x", fail=True), "done"])
    assert tool_texts(request) == ["Error: tool echo failed: RuntimeError: boom"]
    assert request.metrics.tool_errors == 1
    assert request.finish_reason is FinishReason.STOP


async def test_slow_tool_times_out_with_a_tool_message(chat, tool):
    config = RolloutConfig(tool_timeout_s=0.05)
    request, _ = await drive(chat, tool, [call("echo", text="x", sleep=5), "done"], config)
    assert tool_texts(request) == ["Error: tool echo timed out after 0.05 s"]
    assert request.tool_calls[0].latency_s < 1.0


async def test_turn_budget_ends_in_max_turns(chat, tool):
    request, _ = await drive(chat, tool, [call("echo", text="again")], RolloutConfig(max_turns=3))
    assert request.finish_reason is FinishReason.MAX_TURNS
    assert request.metrics.turns == 3
    assert request.metrics.tool_calls == 2  # the last turn's call is not executed


async def test_whole_response_budget_ends_in_length_across_turns(chat, tool):
    script = [call("echo", text="again and again")]
    unbounded, _ = await drive(chat, tool, script, RolloutConfig(max_turns=6))
    assert unbounded.finish_reason is FinishReason.MAX_TURNS and len(unbounded.response_ids) > 200
    request, _ = await drive(chat, tool, script, RolloutConfig(max_turns=6, max_response_tokens=200))
    assert request.finish_reason is FinishReason.LENGTH
    assert 2 <= request.metrics.turns < 6
    assert sum(request.loss_mask) <= 200  # no turn generates past the budget; tool output may end it


async def test_long_turn_ends_in_length(chat, tool):
    request, _ = await drive(chat, tool, ["x" * 50], RolloutConfig(max_new_tokens=10))
    assert request.finish_reason is FinishReason.LENGTH
    assert request.metrics.generated_tokens == 10


async def test_context_budget_ends_in_length(chat, tool):
    config = RolloutConfig(max_model_len=len(chat.prompt_ids(PROMPT)) + 40)
    request, _ = await drive(chat, tool, [call("echo", text="y" * 60), "done"], config)
    assert request.finish_reason is FinishReason.LENGTH
    assert len(request.prompt_ids) + request.metrics.generated_tokens <= config.max_model_len


async def test_engine_failure_ends_the_request_with_error_and_releases(chat, tool):
    request, _ = await drive(chat, tool, [call("echo", text="a"), RuntimeError("server down")])
    assert request.finish_reason is FinishReason.ERROR
    assert "server down" in request.error
    assert request.state is RequestState.COMPLETED
    assert (tool.created, tool.released) == (1, 1)


async def test_failing_create_ends_in_error_and_releases_what_was_created(chat, tokenizer):
    good, bad = CountingTool(), CountingTool({"fail_create": True}, schema=None)
    bad.name = "echo2"
    engine = ScriptedEngine(chat, lambda i, p, r: "hi")
    request = new_request()
    await run_request(request, engine, chat, {"echo": good, "echo2": bad}, RolloutConfig())
    assert request.finish_reason is FinishReason.ERROR
    assert "create refused" in request.error
    assert (good.created, good.released) == (1, 1)


async def test_cancellation_releases_every_created_instance(chat, tool):
    engine = ScriptedEngine(chat, lambda i, p, r: call("echo", text="x", sleep=10))
    requests = [new_request(f"r{i}") for i in range(5)]
    tasks = [asyncio.create_task(run_request(r, engine, chat, {"echo": tool}, RolloutConfig())) for r in requests]
    await asyncio.sleep(0.1)  # all are now inside the slow tool call
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert tool.created == tool.released == 5
    assert all(r.finish_reason is FinishReason.ABORT for r in requests)


async def test_loss_mask_covers_exactly_the_engine_tokens(chat, tool):
    turns = [call("echo", text="one"), call("echo", text="two") + call("echo", text="three"), "the end"]
    request, engine = await drive(chat, tool, turns)
    masked_in = [t for t, m in zip(request.response_ids, request.loss_mask, strict=True) if m == 1]
    assert masked_in == engine.emitted[request.request_id]
    assert all((lp is None) == (m == 0) for lp, m in zip(request.logprobs, request.loss_mask, strict=True))
    assert set(request.weight_versions) == {3, None}
    assert request.loss_mask.count(0) > 0  # template glue and tool output are context


async def test_multi_turn_conversation_passes_the_consistency_check(chat, tool):
    turns = [call("echo", text="one"), call("echo", text="two") + call("echo", text="three"), "the end"]
    request, _ = await drive(chat, tool, turns)
    assert request.consistency_diff is None
    report = chat.check_consistency(request.messages, request.all_ids)
    assert report.ok


async def test_ground_truth_grades_the_last_answer(chat, tool):
    request, _ = await drive(chat, tool, ["it is \\boxed{42}"], request=new_request(ground_truth="42"))
    assert request.rewards.answer == 1.0
    assert request.rewards.final == 1.0


async def test_long_tool_output_is_truncated_in_the_middle(chat, tool):
    config = RolloutConfig(max_tool_response_chars=100, max_new_tokens=512)
    request, _ = await drive(chat, tool, [call("echo", text="a" * 150 + "b" * 150), "done"], config)
    text = tool_texts(request)[0]
    assert len(text) <= 100
    assert text.startswith("a") and text.endswith("b") and "characters cut" in text


def test_truncate_middle_keeps_short_text():
    assert truncate_middle("short", 10) == "short"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_turns": 0}, "max_turns must be >= 1"),
        ({"tool_timeout_s": 0}, "tool_timeout_s must be > 0"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"tool_parser": "nope"}, "unknown tool parser 'nope'"),
    ],
)
def test_bad_settings_are_refused_when_the_config_is_made(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**settings)
