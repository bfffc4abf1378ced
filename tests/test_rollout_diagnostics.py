"""rollout/malformed_call_share and rollout/tool_error_share: what counts as a malformed call and as a
failed one (rollout/stats.py), counted by the request loop."""

from __future__ import annotations

from conftest import ScriptedEngine, call

from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest
from rollout.stats import RolloutCounts

PROMPT = [{"role": "user", "content": "Say hi."}]


async def drive(chat, tool, turns, config=None) -> AsyncRolloutRequest:
    """One request whose assistant turns are ``turns`` (the last repeats)."""
    engine = ScriptedEngine(chat, lambda i, prompt, rid: turns[min(i, len(turns) - 1)])
    request = AsyncRolloutRequest("r0", 0, 0, [dict(m) for m in PROMPT])
    await run_request(request, engine, chat, {tool.name: tool}, config or RolloutConfig())
    return request


def shares(*requests: AsyncRolloutRequest) -> tuple[float, float]:
    metrics = RolloutCounts.of(list(requests)).metrics()
    return metrics["malformed_call_share"], metrics["tool_error_share"]


async def test_a_call_the_parser_cannot_read_is_malformed_and_not_a_tool_error(chat, tool):
    request = await drive(chat, tool, ['<tool_call>{"name": "echo", "arguments": {</tool_call>', call("echo", text="a"),
                                       "done"])  # fmt: skip
    assert (request.metrics.parsed_calls, request.metrics.malformed_calls, request.metrics.failed_calls) == (2, 1, 0)
    assert request.metrics.tool_errors == 1  # (the model read an error either way)
    assert shares(request) == (0.5, 0.0)


async def test_a_broken_call_after_an_answer_counts_as_malformed(chat, tool):
    request = await drive(chat, tool, ['The answer is 4. <tool_call>{"name": "echo"', "4"])
    assert request.tool_calls[0].error.startswith("unclosed <tool_call>")
    assert shares(request) == (1.0, 0.0)


async def test_text_with_no_opening_tag_is_an_answer_not_a_call(chat, tool):
    request = await drive(chat, tool, ['4 </tool_call> {"name": "echo"}'])
    assert request.metrics.parsed_calls == 0 and shares(request) == (0.0, 0.0)


async def test_the_last_turns_calls_count_though_no_turn_is_left_to_run_them(chat, tool):
    request = await drive(chat, tool, ["<tool_call>oops</tool_call>"], RolloutConfig(max_turns=2))
    assert request.metrics.tool_calls == 1  # the first turn's call ran; the second's did not
    assert (request.metrics.parsed_calls, request.metrics.malformed_calls) == (2, 2)


async def test_calls_read_but_failing_are_tool_errors(chat, tool):
    unknown = await drive(chat, tool, [call("search", query="x"), "done"])
    bad_arguments = await drive(chat, tool, [call("echo", words="x"), "done"])
    raised = await drive(chat, tool, [call("echo", text="x", fail=True), "done"])
    fine = await drive(chat, tool, [call("echo", text="x"), "done"])
    assert shares(unknown, bad_arguments, raised, fine) == (0.0, 0.75)


async def test_calls_skipped_beyond_max_parallel_calls_are_tool_errors(chat, tool):
    three = call("echo", text="a") + call("echo", text="b") + call("echo", text="c")
    request = await drive(chat, tool, [three, "done"], RolloutConfig(max_parallel_calls=2))
    assert request.metrics.failed_calls == 1 and shares(request) == (0.0, 1 / 3)


async def test_no_calls_make_both_shares_zero(chat, tool):
    assert shares(await drive(chat, tool, ["hi"])) == (0.0, 0.0)
