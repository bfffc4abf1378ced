"""Environments that hang, exit or lie (issue 50), in the real rollout loop: one never takes the batch down,
every environment is closed exactly once where its close actually ran, and what is wrong is said naming the
environment. The classes are in ``tests/hostile_envs.py``; the command-line cases (the process exits after a
call that never returns, Ctrl-C mid-step) are in ``tests/test_hostile_envs_cli.py``."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import ScriptedEngine

from data.env_tasks import make_env_records
from rollout.config import RolloutConfig
from rollout.envs.interaction import EnvironmentInteraction
from rollout.loop import run_request
from rollout.request import FinishReason
from rollout.runner import RolloutRunner, request_from_record
from rollout.user_threads import stuck_calls

FAST = RolloutConfig(max_new_tokens=64, max_turns=8, interaction_timeout_s=20.0, tool_reward_timeout_s=20.0)
HOSTILE = "tests.hostile_envs"


def spec(name: str) -> str:
    return f"{HOSTILE}:{name}"


def events(log: Path, event: str) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.split()[0] == event) if log.exists() else 0


def interaction(name: str = "Healthy", **config: Any) -> EnvironmentInteraction:
    return EnvironmentInteraction({"name": "env", "env": spec(name), "check": False, **config})


def records_of(log: Path, *kinds: tuple[str, int, dict[str, Any]]) -> list[Any]:
    """``(class name, how many, env_kwargs)`` groups of records, seeds numbered through."""
    records = []
    for name, count, kwargs in kinds:
        for record in make_env_records(spec(name), count, len(records), env_kwargs={"log": str(log), **kwargs}):
            record.index = len(records)
            records.append(record)
    return records


async def run_all(env: EnvironmentInteraction, records: list[Any], chat: Any, config: RolloutConfig = FAST) -> Any:
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: "go")
    result = await RolloutRunner(engine, chat, {}, config, interactions={"env": env}).run(records, 1)
    return {r.prompt_index: r for r in result.requests}


async def eventually(check: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not check() and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert check()


# ----- 1. a call that returns after its deadline is closed, even once the loop has ended ----------------


def test_a_step_that_returns_after_its_deadline_is_closed_on_its_thread_after_the_loop_has_ended(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("Healthy", step_timeout_s=0.2)
    records = records_of(log, ("Healthy", 2, {"step_s": 1.0}))
    requests = asyncio.run(run_all(env, records, chat))  # the loop is closed when this returns
    assert all("step timed out after 0.2 s" in r.error for r in requests.values())
    assert events(log, "close") == 0  # the steps still run ...
    end = time.monotonic() + 10
    while events(log, "close") < 2 and time.monotonic() < end:
        time.sleep(0.05)
    assert events(log, "close") == 2  # ... and each environment is closed on its step's thread once it returns
    assert env.stats.opened == env.stats.closed == 2


# ----- 2. an async close is awaited, and counted where it ran --------------------------------------------


async def test_an_environment_whose_methods_are_all_async_is_closed_by_awaiting_its_close(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("AsyncEnv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        requests = await run_all(env, records_of(log, ("AsyncEnv", 4, {})), chat)
        gc.collect()
    assert all(r.finish_reason is FinishReason.STOP for r in requests.values()), [r.error for r in requests.values()]
    assert events(log, "close") == 4 == env.stats.closed == env.stats.opened
    assert not [w for w in caught if "never awaited" in str(w.message)]


# ----- 3. BaseExceptions from user code end only their request ---------------------------------------------


@pytest.mark.parametrize("name", ["ExitingStep", "AsyncExitingStep"])
@pytest.mark.parametrize("raises", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
async def test_a_step_that_raises_a_base_exception_ends_only_its_own_request(chat, tmp_path, name, raises):
    log = tmp_path / "log"
    env = interaction(name)
    records = records_of(log, ("Healthy", 3, {}), (name, 1, {"raises": raises}))
    requests = await run_all(env, records, chat)
    assert [requests[i].finish_reason for i in range(3)] == [FinishReason.STOP] * 3
    exited = requests[3]
    assert exited.finish_reason is FinishReason.ERROR
    assert f"environment {spec(name)}: step failed: UserExit: it raised {raises}(" in exited.error
    assert env.stats.opened == env.stats.closed == 4 == events(log, "close")


async def test_a_tool_that_raises_system_exit_is_an_error_the_model_reads(chat):
    from tools.function_tool import FunctionTool

    def leave(code: int) -> str:
        """Leave.

        Args:
            code: The exit code.
        """
        raise SystemExit(code)

    async def leave_async(code: int) -> str:
        """Leave, async.

        Args:
            code: The exit code.
        """
        raise SystemExit(code)

    tools = {"leave": FunctionTool(leave), "leave_async": FunctionTool(leave_async)}
    call = '<tool_call>\n{{"name": "{}", "arguments": {{"code": 3}}}}\n</tool_call>'
    script = {0: call.format("leave"), 1: call.format("leave_async")}
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: script.get(turn, "done"))
    from rollout.tokens import ChatTokenizer

    chat_with_tools = ChatTokenizer(chat.tokenizer, [t.schema for t in tools.values()])
    request = request_from_record(make_env_records(spec("Healthy"), 1)[0], 0, 0, "r0")
    request.extra.pop("interaction_kwargs")
    request.messages.append({"role": "user", "content": "leave"})
    done = await run_request(request, engine, chat_with_tools, tools, FAST)
    assert done.finish_reason is FinishReason.STOP
    errors = [record.error for record in done.tool_calls]
    assert errors == ["tool leave failed: UserExit: it raised SystemExit(3)", "tool leave_async failed: SystemExit: 3"]


async def test_a_hung_method_of_an_environment_class_tool_comes_back_as_an_error_and_is_closed_after(chat):
    from rollout.tokens import ChatTokenizer
    from tests.hostile_envs import SlowTools
    from tools.registry import build_tools

    tools = build_tools([{"class_name": "tools.environment_class:EnvironmentMethodTool",
                          "config": {"environment": "tests.hostile_envs:SlowTools"}}])  # fmt: skip
    call = '<tool_call>\n{"name": "wait", "arguments": {"seconds": 2.0}}\n</tool_call>'
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: call if turn == 0 else "done")
    request = request_from_record(make_env_records(spec("Healthy"), 1)[0], 0, 0, "r0")
    request.extra.pop("interaction_kwargs")
    request.messages.append({"role": "user", "content": "wait"})
    before = SlowTools.closed
    config = RolloutConfig(max_new_tokens=64, max_turns=4, tool_timeout_s=0.3)
    done = await run_request(request, engine, ChatTokenizer(chat.tokenizer, [tools["wait"].schema]), tools, config)
    assert done.finish_reason is FinishReason.STOP and done.tool_calls[0].error == "tool wait timed out after 0.3 s"
    assert stuck_calls().get(("environment tests.hostile_envs:SlowTools", "wait")) == 1
    assert SlowTools.closed == before  # released while its call ran: closed on that call's thread ...
    await eventually(lambda: SlowTools.closed == before + 1)  # ... once it returned
    assert tools["wait"].environment.stats.closed == tools["wait"].environment.stats.opened == 1


# ----- 4. hung calls never starve the healthy ones ----------------------------------------------------------


async def test_hung_resets_do_not_hold_the_threads_healthy_environments_need(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("Healthy", threads=4, reset_timeout_s=0.5)
    records = records_of(log, ("HangingReset", 6, {"reset_s": 4.0}), ("Healthy", 10, {}))
    started = time.monotonic()
    requests = await run_all(env, records, chat)
    assert time.monotonic() - started < 3.5  # the healthy ran once the hung ones passed their deadline
    hung, healthy = [requests[i] for i in range(6)], [requests[i] for i in range(6, 16)]
    assert all(r.finish_reason is FinishReason.STOP for r in healthy), [r.error for r in healthy]
    assert all(f"environment {spec('HangingReset')}: reset timed out after 0.5 s" in r.error for r in hung)
    assert stuck_calls().get((f"environment {spec('HangingReset')}", "reset")) == 6
    await eventually(lambda: events(log, "close") == 16)  # closed once their resets returned
    assert (f"environment {spec('HangingReset')}", "reset") not in stuck_calls()


async def test_past_max_stuck_calls_new_calls_are_refused_naming_the_stuck_ones(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("Healthy", threads=2, reset_timeout_s=0.3, max_stuck=2)
    first = await run_all(env, records_of(log, ("HangingReset", 2, {"reset_s": 3.0})), chat)
    assert all("reset timed out" in r.error for r in first.values())
    refused = await run_all(env, records_of(log, ("Healthy", 1, {})), chat)
    assert f"refused: 2 calls of env-env are stuck past their deadline (environment {spec('HangingReset')}: 2 reset" \
        in refused[0].error  # fmt: skip
    await eventually(lambda: events(log, "close") == 2)
    again = await run_all(env, records_of(log, ("Healthy", 1, {})), chat)
    assert again[0].finish_reason is FinishReason.STOP  # their threads back: calls are taken again


# ----- 7. observations and info bounded, the first observation included ------------------------------------


async def test_the_first_observation_is_cut_as_a_step_observation_is(chat, tmp_path):
    requests = await run_all(interaction("HugeReset"), records_of(tmp_path / "log", ("HugeReset", 1, {})), chat)
    first = requests[0].messages[1]["content"]
    assert requests[0].messages[0]["role"] == "system" and len(requests[0].messages[0]["content"]) > 0
    assert len(first) <= FAST.max_tool_response_chars and len(requests[0].prompt_ids) < 3000  # not 5 M


async def test_a_huge_info_is_dropped_with_a_note_and_a_circular_one_ends_its_request_naming_the_environment(
    chat, tmp_path
):
    log = tmp_path / "log"
    env = interaction("HugeInfo")
    requests = await run_all(env, records_of(log, ("HugeInfo", 1, {}), ("CircularInfo", 1, {})), chat)
    info = requests[0].interaction_turns[0].metadata["info"]
    assert requests[0].finish_reason is FinishReason.STOP
    assert info == {"dropped": "an info of 5,000,11 characters, over max_info_chars 16,384".replace("11", "011")}
    assert f"environment {spec('CircularInfo')}: step info cannot be written as JSON" in requests[1].error
    assert env.stats.opened == env.stats.closed == 2


# ----- 8. wrong shapes are errors, not text ----------------------------------------------------------------


async def test_wrong_shapes_are_errors_naming_the_environment_and_utf8_bytes_are_text(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("Healthy")
    records = records_of(log, ("StepShapedReset", 1, {}), ("BytesObservation", 1, {}), ("ObjectObservation", 1, {}))
    requests = await run_all(env, records, chat)
    assert f"environment {spec('StepShapedReset')}: reset returned a tuple of 5 (what a step returns)" \
        in requests[0].error  # fmt: skip
    assert requests[1].messages[1]["content"] == "Game 1: say go."  # UTF-8 bytes: the text
    assert f"environment {spec('BytesObservation')}: an observation of bytes that are not UTF-8" in requests[1].error
    assert f"environment {spec('ObjectObservation')}: an observation of type object is not text" in requests[2].error


# ----- 9. errors name the environment ----------------------------------------------------------------------


async def test_a_close_that_raises_or_hangs_and_a_reward_that_is_no_number_name_the_environment(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("Healthy", reset_timeout_s=0.5)
    records = records_of(log, ("RaisingClose", 1, {}), ("HangingClose", 1, {"close_s": 3.0}), ("StringReward", 1, {}))
    requests = await run_all(env, records, chat)
    assert f"environment {spec('RaisingClose')}: close failed: OSError: [Errno 5] the board would not fold" \
        in requests[0].error  # fmt: skip
    assert f"environment {spec('HangingClose')}: close timed out after 0.5 s" in requests[1].error
    assert f"environment {spec('StringReward')}: step reward 'abc' is not a number" in requests[2].error
    assert env.stats.closed == 2 and env.stats.opened == 3  # the hanging close has not run to its end
    assert stuck_calls().get((f"environment {spec('HangingClose')}", "close")) == 1


# ----- 10. an async step that blocks the loop is named; the others keep their time --------------------------


async def test_an_async_step_that_blocks_the_loop_fails_itself_not_the_healthy_environments(chat, tmp_path):
    log = tmp_path / "log"
    env = interaction("AsyncHealthy", step_timeout_s=0.6)
    records = records_of(log, ("AsyncHealthy", 6, {"step_s": 0.4}), ("BlockingAsyncStep", 1, {"step_s": 1.2}))
    requests = await run_all(env, records, chat)
    healthy = [requests[i] for i in range(6)]
    assert all(r.finish_reason is FinishReason.STOP for r in healthy), [r.error for r in healthy]
    blocked = requests[6]
    assert f"environment {spec('BlockingAsyncStep')}: step blocked the event loop for 1.2 s, over its 0.6 s deadline" \
        in blocked.error  # fmt: skip
    assert env.stats.opened == env.stats.closed == 7


def test_a_worker_thread_of_an_environment_is_a_daemon(chat, tmp_path):
    env = interaction("Healthy")
    asyncio.run(run_all(env, records_of(tmp_path / "log", ("Healthy", 1, {})), chat))
    workers = [t for t in threading.enumerate() if t.name.startswith("env-env")]
    assert workers and all(t.daemon for t in workers)
