"""TRL's environment classes as tools (tools/environment_class.py): one tool per public method, schemas
as TRL derives them, one instance per request shared by its tools, reset with the record's create_kwargs,
the environment's reward once, closed once; through the tool registry and the rollout loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import ScriptedEngine, call
from fixtures.trl_envs import CounterEnv
from transformers.utils import get_json_schema

from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool, ToolError
from tools.environment_class import EnvironmentMethodTool
from tools.registry import ToolConfigError, build_tools, load_tools

CLASS = "tools.environment_class:EnvironmentMethodTool"
COUNTER = "fixtures.trl_envs:CounterEnv"
PROMPT = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Reach the target."}]


def env_tools(environment: str = COUNTER, **config: Any) -> dict[str, BaseTool]:
    return build_tools([{"class_name": CLASS, "config": {"environment": environment, **config}}])


@pytest.fixture(autouse=True)
def fresh_counters():
    CounterEnv.made.clear()
    yield
    CounterEnv.made.clear()


async def create_all(tools: dict[str, BaseTool], instance_id: str, kwargs: dict[str, dict[str, Any]]) -> None:
    for name, tool in tools.items():  # as the loop does: one after another, the request id as instance id
        await tool.create(instance_id, **kwargs.get(name, {}))


async def release_all(tools: dict[str, BaseTool], instance_id: str) -> None:
    for tool in tools.values():
        await tool.release(instance_id)


# ----- schemas and config --------------------------------------------------------------------------------


def test_each_public_method_is_a_tool_with_the_schema_trl_derives_from_its_docstring():
    tools = env_tools()
    assert list(tools) == ["decrement", "increment", "pause"]  # not reset, get_reward, close, rules, _check
    probe = CounterEnv()
    for name, tool in tools.items():
        assert tool.schema == get_json_schema(getattr(probe, name))  # TRL's call, on a bound method
    increment = tools["increment"].schema["function"]
    assert increment["description"] == "Increment the internal counter."
    assert increment["parameters"]["properties"]["step"] == {
        "type": "integer",
        "description": "Value to add to the counter.",
    }
    assert "required" not in tools["decrement"].schema["function"]["parameters"]  # step has a default


def test_methods_picks_the_tools_and_the_entry_shares_one_environment():
    tools = env_tools(methods=["increment", "decrement"])
    assert list(tools) == ["increment", "decrement"]
    assert tools["increment"].environment is tools["decrement"].environment


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"environment": "fixtures.trl_envs:UndocumentedEnv"}, "method fixtures.trl_envs:UndocumentedEnv.move: "),
        ({"environment": "fixtures.trl_envs:UntypedEnv"}, "UntypedEnv.move: its schema comes from its type hints"),
        ({}, "tools[0].config.environment: expected the class's import path"),
        ({"environment": "fixtures.trl_envs:Nowhere"}, "config.environment: cannot import 'fixtures.trl_envs:Nowhere'"),
        ({"environment": COUNTER, "methods": ["reset"]}, "has no public method reset to offer as a tool; its tools: "),
        ({"environment": COUNTER, "kwargs": [1]}, "tools[0].config.kwargs: expected a mapping"),
        ({"environment": COUNTER, "steps": 3}, "tools[0].config: unknown field(s) steps"),
        ({"environment": "tools.function_tool:derive_schema"}, "is not a class"),
    ],
)
def test_a_bad_entry_names_the_entry_the_class_and_the_method(config, message):
    with pytest.raises(ToolConfigError, match=r"^<tools>: tools\[0\]") as error:
        build_tools([{"class_name": CLASS, "config": config}])
    assert message in str(error.value)


def test_undocumented_message_names_what_is_missing():
    with pytest.raises(ToolConfigError, match="has no docstring"):
        env_tools("fixtures.trl_envs:UndocumentedEnv")


class JunkBuilder:
    @classmethod
    def build_tools(cls, entry, where, source_dir):
        return ["not a tool"]


def test_the_registry_hook_takes_a_classmethod_build_tools_and_checks_what_it_returns():
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: test_environment_class_tools:JunkBuilder.build_tools must"):
        build_tools([{"class_name": "test_environment_class_tools:JunkBuilder"}])


# ----- the lifecycle, directly ---------------------------------------------------------------------------


async def test_the_lifecycle_from_a_yaml_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        f"tools:\n  - class_name: {CLASS}\n    config: {{environment: '{COUNTER}', kwargs: {{start: 1}}}}\n"
    )
    tools = load_tools(path)
    await create_all(tools, "req-1", {"increment": {"target": 4, "split": "train"}})
    [env] = CounterEnv.made
    assert env.start == 1 and env.resets == [{"target": 4, "split": "train"}]
    assert (await tools["increment"].execute("req-1", {"step": 2})).text == "3"  # str() of the int, as TRL
    assert (await tools["increment"].execute("req-1", {"step": 2})).text == "5"
    assert (await tools["decrement"].execute("req-1", {"step": 1})).text == "counter: 4"  # async method, awaited
    rewards = [await tool.calc_reward("req-1") for tool in tools.values()]
    assert rewards == [1.0, 0.0, 0.0]  # the environment's reward, reported once
    await release_all(tools, "req-1")
    assert env.closed == 1 and len(CounterEnv.made) == 1
    assert tools["increment"].environment.live == {}
    assert tools["increment"].environment.stats.opened == tools["increment"].environment.stats.closed == 1


async def test_reset_waits_for_every_tool_of_the_request_and_takes_the_union_of_their_create_kwargs():
    tools = env_tools()
    await tools["decrement"].create("r", target=3)
    await tools["increment"].create("r", mode="easy")
    assert CounterEnv.made == []  # pause is not created yet
    await tools["pause"].create("r")
    assert CounterEnv.made[0].resets == [{"target": 3, "mode": "easy"}]
    await release_all(tools, "r")


async def test_two_values_for_one_reset_kwarg_are_refused_naming_both_tools():
    tools = env_tools()
    await tools["decrement"].create("r", target=3)
    with pytest.raises(ToolError, match="tools decrement and increment give 'target' two values"):
        await tools["increment"].create("r", target=4)
    await release_all(tools, "r")
    assert tools["increment"].environment.live == {}


async def test_requests_get_their_own_instances_and_sync_methods_run_in_worker_threads():
    tools = env_tools()
    await create_all(tools, "a", {"increment": {"target": 1}})
    await create_all(tools, "b", {"increment": {"target": 2}})
    await tools["increment"].execute("a", {"step": 1})
    await tools["increment"].execute("b", {"step": 1})
    assert [await tools["decrement"].calc_reward(r) for r in ("a", "b")] == [1.0, 0.0]
    a, b = CounterEnv.made
    assert a.threads and all(name.startswith("env-CounterEnv") for name in a.threads)
    await release_all(tools, "a")
    assert (a.closed, b.closed) == (1, 0)
    await release_all(tools, "b")
    assert (a.closed, b.closed) == (1, 1)


async def test_what_a_method_raises_comes_back_as_a_tool_error_with_its_message():
    tools = env_tools()
    await create_all(tools, "r", {"increment": {"target": 1}})
    with pytest.raises(ToolError, match=r"^step must be positive, got -2$"):
        await tools["decrement"].execute("r", {"step": -2})
    assert tools["decrement"].environment.stats.errors == 1
    await release_all(tools, "r")


async def test_calls_on_one_instance_run_one_at_a_time():
    tools = env_tools()
    await create_all(tools, "r", {"increment": {"target": 1}})
    await asyncio.gather(*(tools["pause"].execute("r", {"seconds": 0.05}) for _ in range(3)))
    assert CounterEnv.made[0].most_inside == 1
    await release_all(tools, "r")


async def test_a_call_past_its_deadline_blocks_the_next_and_the_close_waits_for_it():
    tools = env_tools()
    await create_all(tools, "r", {"increment": {"target": 1}})
    [env] = CounterEnv.made
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):  # the loop's tool_timeout_s
            await tools["pause"].execute("r", {"seconds": -1})
    with pytest.raises(ToolError, match="pause: its previous call still runs past its deadline"):
        await tools["pause"].execute("r", {"seconds": 0})
    await release_all(tools, "r")
    assert env.closed == 0  # the stuck call still runs
    env.release_pause.set()
    await closed_once(env)


async def closed_once(env: CounterEnv) -> None:
    """Wait (up to a second) for the close that follows a stuck call once it returns; it happens once."""
    for _ in range(100):
        await asyncio.sleep(0.01)
        if env.closed:
            break
    assert env.closed == 1


async def test_an_attribute_can_be_the_reward_as_trl_reward_functions_read_env_reward():
    tools = env_tools("fixtures.trl_envs:ScoreAttributeEnv", reward="reward")
    await create_all(tools, "r", {})
    await tools["echo"].execute("r", {"message": "hello"})
    assert await tools["echo"].calc_reward("r") == 5.0
    await release_all(tools, "r")


async def test_a_resets_observation_is_given_once_for_the_prompt():
    tools = env_tools(kwargs={"announce": True})
    await create_all(tools, "r", {"increment": {"target": 2}})
    assert tools["pause"].initial_observation("r") == "Reach 2."
    assert tools["increment"].initial_observation("r") is None  # once per instance, not once per tool
    await release_all(tools, "r")


# ----- through the rollout loop ----------------------------------------------------------------------------


def new_request(rid: str = "r0", target: int = 3) -> AsyncRolloutRequest:
    kwargs = {"increment": {"create_kwargs": {"target": target}}}
    return AsyncRolloutRequest(rid, 0, 0, [dict(m) for m in PROMPT], tools_kwargs=kwargs)


async def rollout(tokenizer, turns, request=None, config=None, tools=None):
    tools = tools or env_tools()
    chat = ChatTokenizer(tokenizer, [tool.schema for tool in tools.values()])
    engine = ScriptedEngine(chat, lambda i, prompt, rid: turns[min(i, len(turns) - 1)])
    request = request or new_request()
    await run_request(request, engine, chat, tools, config or RolloutConfig(max_new_tokens=128))
    return request, tools


async def test_a_request_calls_the_environment_and_gets_its_reward_once(tokenizer):
    turns = [call("increment", step=2), call("increment", step=1) + call("decrement", step=1), "done"]
    request, tools = await rollout(tokenizer, turns, new_request(target=2))
    assert request.finish_reason is FinishReason.STOP, request.error
    assert [m["content"] for m in request.messages if m["role"] == "tool"] == ["2", "3", "counter: 2"]
    assert request.rewards.tools == {"decrement": 1.0, "increment": 0.0, "pause": 0.0}
    [env] = CounterEnv.made
    assert env.resets == [{"target": 2}] and env.closed == 1
    assert tools["increment"].environment.live == {}


async def test_what_reset_returns_is_appended_to_the_last_user_message_as_trl_does(tokenizer):
    request, _ = await rollout(tokenizer, ["done"], new_request(target=4), tools=env_tools(kwargs={"announce": True}))
    assert request.finish_reason is FinishReason.STOP, request.error
    users = [m["content"] for m in request.messages if m["role"] == "user"]
    assert users == [PROMPT[-1]["content"] + "Reach 4."] and request.consistency_diff is None
    assert "Reach 4." in ChatTokenizer(tokenizer, []).tokenizer.decode(request.prompt_ids)


async def test_an_engine_error_still_closes_the_environment_once(tokenizer):
    request, tools = await rollout(tokenizer, [call("increment", step=1), RuntimeError("engine down")])
    assert request.finish_reason is FinishReason.ERROR and "engine down" in request.error
    assert [env.closed for env in CounterEnv.made] == [1]
    assert tools["increment"].environment.stats.opened == 1


async def test_a_failed_reset_ends_the_request_and_closes_the_made_environment_once(tokenizer):
    request = AsyncRolloutRequest("r0", 0, 0, [dict(m) for m in PROMPT])  # no target for reset
    request, tools = await rollout(tokenizer, ["never"], request)
    assert request.finish_reason is FinishReason.ERROR
    assert "create of tool pause failed" in request.error and "reset failed: TypeError" in request.error
    assert [env.closed for env in CounterEnv.made] == [1]
    assert request.rewards.tools == {"decrement": 0.0, "increment": 0.0}  # the failure was reported once
    assert tools["pause"].environment.live == {}


async def test_cancelling_a_request_mid_call_closes_the_environment_once_the_call_returns(tokenizer):
    tools = env_tools()
    chat = ChatTokenizer(tokenizer, [tool.schema for tool in tools.values()])
    engine = ScriptedEngine(chat, lambda i, prompt, rid: call("pause", seconds=-1))
    task = asyncio.create_task(run_request(new_request(), engine, chat, tools, RolloutConfig(max_new_tokens=128)))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if CounterEnv.made and CounterEnv.made[0].inside:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [env] = CounterEnv.made
    assert tools["pause"].environment.live == {} and env.closed == 0
    env.release_pause.set()
    await closed_once(env)


async def test_the_embedded_model_sees_the_schemas_and_the_environment_lives_exactly_its_request():
    from rollout.api import resolve_model
    from rollout.engines.local import LocalEngine
    from rollout.tokens import load_tokenizer

    tools = env_tools()
    model_dir = resolve_model(None)
    chat = ChatTokenizer(load_tokenizer(model_dir), [tool.schema for tool in tools.values()])
    async with LocalEngine.from_pretrained(model_dir) as engine:
        request = await run_request(new_request(), engine, chat, tools, RolloutConfig(max_new_tokens=32))
    assert request.error is None and request.consistency_diff is None
    prompt = chat.decode(request.prompt_ids)
    assert "Increment the internal counter." in prompt and '"name": "decrement"' in prompt
    assert [(len(env.resets), env.closed) for env in CounterEnv.made] == [(1, 1)]
    assert isinstance(tools["increment"], EnvironmentMethodTool)
