"""OpenEnv environments (openenv 0.10, real servers on loopback): a typed environment as the other side of
the conversation (``rollout/envs/openenv.py``), a server that dies mid-episode, and an MCP environment as
tools (``tools/openenv_mcp.py``). The servers are the tests' own environments (``tests/openenv_envs.py``)
served by openenv's ``create_app`` in subprocesses rallyrl starts (``tools/openenv_server.py``)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import pytest
from conftest import ScriptedEngine, call
from env_checks import Recorder, check_conversation
from openenv_envs import ROUNDS

from data.schema import Record
from rollout.api import resolve_model
from rollout.config import RolloutConfig
from rollout.engines.local import LocalEngine
from rollout.envs.interaction import EnvironmentInteraction
from rollout.envs.openenv import OpenEnvBinding
from rollout.envs.step import EnvError
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.runner import RolloutRunner, request_from_record
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.base import ToolError
from tools.loading import ToolConfigError
from tools.openenv_mcp import OpenEnvMCPTool
from tools.openenv_server import local_server, stop_local_servers
from tools.registry import build_tools

COUNTER = "openenv_envs:counter_app"
CRASH = "openenv_envs:CrashEnv"
TARGET = "openenv_envs:target_app"
CONFIG = RolloutConfig(max_new_tokens=128, max_turns=8, seed=7)
SYSTEM = [{"role": "system", "content": "You are playing a game. Each of your replies is your next move."}]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def chat(model_dir) -> ChatTokenizer:
    return ChatTokenizer(load_tokenizer(model_dir), [])


@pytest.fixture
def counter_url() -> Any:
    """The counter game's server, as the first episode would start it (again after an interaction's exit
    stopped it)."""
    yield local_server(COUNTER, "env").url
    OpenEnvBinding.shutdown()


@pytest.fixture(scope="module")
def target_tools() -> Any:
    """The MCP environment's tools, built from a tool config entry (the server started once for the module)."""
    yield build_tools([{"class_name": "tools.openenv_mcp:OpenEnvMCPTools", "config": {"app": TARGET}}])
    stop_local_servers("tools")


def records(spec: str, num: int, name: str = "env", **env_kwargs: Any) -> list[Record]:
    kwargs = {"env": spec, "env_kwargs": env_kwargs} if env_kwargs else {"env": spec}
    return [Record(prompt=list(SYSTEM), data_source=spec, extra={"interaction_kwargs": {"name": name, "seed": i,
                   **kwargs}}, index=i) for i in range(num)]  # fmt: skip


async def play(
    records: list[Record],
    interactions: dict[str, EnvironmentInteraction],
    model_dir: Any,
    chat: ChatTokenizer,
    count: tuple[str, int] | None = None,
) -> tuple[list[AsyncRolloutRequest], dict[str, list[int]], dict[str, int]]:
    """Every record as one request of a batch (RolloutRunner), with the embedded model; the interactions
    entered first (their start checks) and left after (which stops the servers they started). ``count``:
    ``(url, closed_at_least)`` of a server whose session counts are read before that."""
    counts: dict[str, int] = {}
    async with LocalEngine.from_pretrained(model_dir) as local:
        for interaction in interactions.values():
            await interaction.__aenter__()  # its start check: one episode reset and closed
        try:
            recorder = Recorder(local)
            runner = RolloutRunner(recorder, chat, {}, CONFIG, progress=False, interactions=interactions)
            result = await runner.run(records)
            if count is not None:
                counts = await asyncio.to_thread(server_counts, *count)
        finally:
            for interaction in interactions.values():
                await interaction.__aexit__(None, None, None)
    return result.requests, recorder.emitted, counts


def server_counts(url: str, closed_at_least: int) -> dict[str, int]:
    """The server's own count of sessions opened and closed (closes land just after the client's)."""
    deadline = time.monotonic() + 5.0
    while True:
        counts = httpx.get(f"{url}/counts", timeout=5.0, trust_env=False).json()
        if counts["closed"] >= closed_at_least or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


# ----- a typed environment as the other side of the conversation -------------------------------------


async def test_a_typed_openenv_environment_is_played_turn_by_turn(counter_url, model_dir, chat):
    before = server_counts(counter_url, 0)
    interaction = EnvironmentInteraction({"name": "env", "env": f"openenv:{COUNTER}"})
    requests, emitted, after = await play(records(f"openenv:{COUNTER}", 3), {"env": interaction}, model_dir, chat,
                                          count=(counter_url, before["closed"] + 4))  # fmt: skip

    for seed, request in enumerate(requests):
        check_conversation(request, emitted[request.request_id], chat)
        assert request.messages[1] == {"role": "user", "content": f"Counter game (seed {seed}): make {ROUNDS} moves."}
        moves = [m["content"] for m in request.messages if m["role"] == "assistant"]
        observations = [m["content"] for m in request.messages if m["role"] == "user"][1:]
        assert observations == [f"Move {n}: {len(moves[n - 1])} characters." for n in range(1, ROUNDS)]
        assert [t.score for t in request.interaction_turns] == [0.1, 0.2, 0.3]  # the environment's rewards
        last = request.interaction_turns[-1]
        assert last.terminated and last.metadata["info"] == {"move": 3}
        assert request.rewards.final == request.rewards.interaction == pytest.approx(0.6)
    assert interaction.stats.opened == interaction.stats.closed == 4  # three episodes and the start check's
    with pytest.raises(httpx.ConnectError):  # the interaction's exit stopped the server it started
        httpx.get(f"{counter_url}/health", timeout=5.0, trust_env=False)
    assert after["opened"] - before["opened"] == after["closed"] - before["closed"] == 4  # sessions, server side


async def test_a_running_openenv_server_is_reached_by_its_url(counter_url, model_dir, chat):
    spec = f"openenv:{counter_url}"
    interaction = EnvironmentInteraction({"name": "env", "env": spec, "env_kwargs": {"observation_field": "prompt"}})
    requests, emitted, _ = await play(records(spec, 1, action_field="message"), {"env": interaction}, model_dir, chat)
    check_conversation(requests[0], emitted[requests[0].request_id], chat)
    assert requests[0].rewards.interaction == pytest.approx(0.6)
    assert interaction.stats.opened == interaction.stats.closed == 2


async def test_the_action_field_comes_from_the_servers_schema_or_is_named(counter_url):
    binding = await asyncio.to_thread(OpenEnvBinding, COUNTER)
    assert binding.url == counter_url and binding.action_field == "message"  # CounterAction's one string field
    assert await binding.reset(5, []) == f"Counter game (seed 5): make {ROUNDS} moves."
    step = await binding.step("abc")
    assert (step.observation, step.reward, step.done, step.info) == ("Move 1: 3 characters.", 0.1, False, {"move": 1})
    await binding.close()
    with pytest.raises(ValueError, match="only apply to a server rallyrl starts"):
        OpenEnvBinding(counter_url, max_sessions=4)


async def test_an_openenv_server_that_dies_mid_episode_ends_only_its_requests(counter_url, model_dir, chat):
    crash = EnvironmentInteraction({"name": "crash", "env": f"openenv:{CRASH}"})
    counter = EnvironmentInteraction({"name": "env", "env": f"openenv:{COUNTER}"})
    batch = records(f"openenv:{COUNTER}", 3) + records(f"openenv:{CRASH}", 2, name="crash")
    dead_url = (await asyncio.to_thread(local_server, CRASH, "env")).url
    requests, _, _ = await play(batch, {"env": counter, "crash": crash}, model_dir, chat)

    assert [r.finish_reason for r in requests] == [FinishReason.STOP] * 3 + [FinishReason.ERROR] * 2
    assert all(r.rewards.interaction == pytest.approx(0.6) for r in requests[:3])  # the batch went on
    for request in requests[3:]:
        assert f"environment openenv:{CRASH}" in request.error
        assert f"the OpenEnv server of {CRASH} at http://127.0.0.1:" in request.error
        assert "exited (exit code 3)" in request.error
    assert crash.stats.opened == crash.stats.closed and counter.stats.opened == counter.stats.closed
    # the next episode gets a new server
    binding = await asyncio.to_thread(OpenEnvBinding, CRASH)
    assert binding.url != dead_url and "seed 1" in await binding.reset(1, [])
    assert (await binding.step("a")).reward == 0.1
    await binding.close()


# ----- an MCP environment as tools ------------------------------------------------------------------


def target_of(seed: int) -> int:
    return random.Random(seed).randrange(10)


def test_openenv_mcp_tools_carry_the_environments_schemas(target_tools):
    assert sorted(target_tools) == ["add", "guess"]
    assert all(isinstance(tool, OpenEnvMCPTool) for tool in target_tools.values())
    guess = target_tools["guess"].schema["function"]
    assert guess["description"] == "Guess the hidden number (0 to 9)."
    assert guess["parameters"]["properties"] == {"number": {"type": "integer"}}
    assert target_tools["add"].check_arguments({"a": 1}) == "'b' is a required property"


async def test_an_openenv_mcp_episode_runs_the_tool_lifecycle(target_tools):
    add, guess = target_tools["add"], target_tools["guess"]
    environment = add.environment
    before = server_counts(environment.url, 0)
    assert await add.create("r1", seed=5) == "r1" and await guess.create("r1", seed=5) == "r1"
    assert len(environment.episodes) == 1  # one episode for the request, shared by its tools

    assert (await add.execute("r1", {"a": 2, "b": 40})).text == "42"
    wrong = await guess.execute("r1", {"number": (target_of(5) + 1) % 10})
    assert (wrong.text, wrong.reward) == ("lower" if target_of(5) < 9 else "higher", 0.1)
    with pytest.raises(ToolError, match=r"(?s)guess: .*valid integer"):
        await guess.execute("r1", {"number": "x"})  # the environment's error, for the model to read
    right = await guess.execute("r1", {"number": target_of(5)})
    assert (right.text, right.reward, right.metrics) == ("correct", 1.0, {"done": True})
    with pytest.raises(ToolError, match="is over"):
        await add.execute("r1", {"a": 1, "b": 1})

    assert await add.calc_reward("r1") == pytest.approx(1.2) and await guess.calc_reward("r1") == 0.0
    await add.release("r1")
    assert len(environment.episodes) == 1
    await guess.release("r1")
    assert environment.episodes == {}
    after = server_counts(environment.url, before["closed"] + 1)
    assert after["opened"] - before["opened"] == after["closed"] - before["closed"] == 1


async def test_a_request_with_openenv_mcp_tools_opens_one_episode_and_closes_it_once(target_tools, model_dir):
    tools_chat = ChatTokenizer(load_tokenizer(model_dir), [tool.schema for tool in target_tools.values()])
    environment = target_tools["add"].environment
    before = server_counts(environment.url, 0)
    seeded = {"create_kwargs": {"seed": 3}}
    record = Record(prompt=[{"role": "user", "content": "Find the hidden number."}], data_source="target",
                    tools_kwargs={"add": seeded, "guess": seeded})  # fmt: skip

    async with LocalEngine.from_pretrained(model_dir) as engine:
        embedded = await run_request(request_from_record(record, 0, 0, "m0"), engine, tools_chat, target_tools, CONFIG)
    assert embedded.finish_reason is not FinishReason.ERROR, embedded.error
    prompt = tools_chat.decode(embedded.prompt_ids)
    assert "Guess the hidden number (0 to 9)." in prompt and '"add"' in prompt  # the schemas, rendered

    script = [call("add", a=1, b=2) + call("guess", number=target_of(3)), "Found it."]  # two calls in one turn
    scripted = ScriptedEngine(tools_chat, lambda turn, prompt, rid: script[turn])
    request = await run_request(request_from_record(record, 0, 0, "s0"), scripted, tools_chat, target_tools, CONFIG)
    assert request.finish_reason is FinishReason.STOP and request.error is None
    assert [r.text for r in request.tool_calls] == ["3", "correct"] and request.rewards.step == [0.1, 1.0]
    assert request.rewards.tools == {"add": pytest.approx(1.1), "guess": 0.0}  # counted once
    assert request.rewards.final == pytest.approx(1.1) and request.consistency_diff is None

    assert environment.episodes == {}
    after = server_counts(environment.url, before["closed"] + 2)
    assert after["opened"] - before["opened"] == after["closed"] - before["closed"] == 2  # one per request


def test_openenv_mcp_tool_entries_are_checked(target_tools):
    entry = {"class_name": "tools.openenv_mcp:OpenEnvMCPTools"}
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.config: give exactly one of 'url'"):
        build_tools([{**entry, "config": {}}])
    with pytest.raises(ToolConfigError, match=r"config\.tools: openenv_envs:target_app has no tool\(s\) nope"):
        build_tools([{**entry, "config": {"app": TARGET, "tools": ["nope"]}}])
    assert list(build_tools([{**entry, "config": {"app": TARGET, "tools": ["guess"]}}])) == ["guess"]


async def test_an_environment_that_cannot_be_served_fails_the_start_check_naming_why(counter_url):
    interaction = EnvironmentInteraction({"name": "env", "env": "openenv:openenv_envs:Nope"})
    why = r"(?s)openenv:openenv_envs:Nope.*exited before it was ready.*no attribute 'Nope'"
    with pytest.raises(EnvError, match=why):
        await interaction.__aenter__()
