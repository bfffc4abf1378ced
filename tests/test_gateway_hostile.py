"""The agent gateway (``rollout/gateway/app.py``) against clients that misbehave: malformed calls, unknown
and finished sessions, too many sessions, bad rewards, clients that walk away mid-call, agents that
vanish, a thousand sessions at once, and streams that must say exactly what the JSON answer says.

Everything goes through real HTTP on loopback (aiohttp or the ``openai`` SDK). The scripted engine
double (``conftest.ScriptedEngine``) is used where the answer must be known in advance; the embedded
model (``rollout.api.open_engine``) where the engine's own abort and streaming must be real.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from conftest import ScriptedEngine, call, random_delay

from data.agents.calc_openai import CALCULATOR
from rollout.api import open_engine, resolve_model
from rollout.config import EngineConfig, GatewayConfig, RolloutConfig
from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.local import LocalEngine
from rollout.engines.local_model import load_model
from rollout.gateway import Gateway
from rollout.gateway.chats import ChatCache
from rollout.request import AsyncRolloutRequest
from rollout.tokens import ChatTokenizer, load_tokenizer

TOOLS = [CALCULATOR]
JSON = {"Content-Type": "application/json"}


# ----- the scripted model and the gateway around it ----------------------------------------------------


def calc_script(turn: int, prompt: str, rid: str) -> str | Exception:
    """The scripted model, a function of the whole prompt (so a session that saw another session's
    messages answers with the other's task number): with tools, first a calculator call on the
    prompt's task number, then the tool's result; without tools, the last user message echoed."""
    if "EXPLODE" in prompt:
        return EngineError("the engine blew up")
    tasks = re.findall(r"task (\d+)", prompt)
    task = tasks[0] if tasks else "?"
    if "<tools>" not in prompt:
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        return f"you said: {last_user}"
    results = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    if not results:
        return f"Let me compute task {task}. " + call("calculator", expression=f"{task}+1")
    return f"task {task}: the answer is {results[-1]}"


@pytest.fixture
def scripted(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(ChatTokenizer(tokenizer, None), calc_script)


@contextlib.asynccontextmanager
async def gateway_on(
    engine: Any, tokenizer: Any, rollout: RolloutConfig | None = None, limit: int = 100,
    on_finish: Callable[[AsyncRolloutRequest], None] | None = None, **config: Any,
) -> AsyncIterator[tuple[Gateway, aiohttp.ClientSession]]:  # fmt: skip
    """A gateway over ``engine`` serving on loopback, and an HTTP client of it."""
    gateway = Gateway(engine, tokenizer, GatewayConfig(**config), rollout or RolloutConfig(), on_finish=on_finish)
    async with gateway, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)) as http:
        yield gateway, http


async def open_session(gateway: Gateway, http: aiohttp.ClientSession, **body: Any) -> str:
    async with http.post(f"{gateway.url}/sessions", json=body) as response:
        assert response.status == 201, await response.text()
        return (await response.json())["session_id"]


async def post(http: aiohttp.ClientSession, url: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kwargs) as response:
        return response.status, await response.json(content_type=None)


def chat_url(gateway: Gateway, sid: str) -> str:
    return f"{gateway.base_url(sid)}/chat/completions"


def error_of(status: int, body: Any, expected_status: int) -> dict[str, Any]:
    """The OpenAI error object of an answer that must be an error with ``expected_status``."""
    assert status == expected_status, body
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


async def finish(gateway: Gateway, http: aiohttp.ClientSession, sid: str, **body: Any) -> dict[str, Any]:
    status, answer = await post(http, f"{gateway.url}/sessions/{sid}/finish", body)
    assert status == 200, answer
    return answer["trajectory"]


async def first_call(gateway: Gateway, http: aiohttp.ClientSession, sid: str) -> list[dict[str, Any]]:
    """The session's first call (a calculator call comes back); the messages an extension resends."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task 7: add one"}]
    status, answer = await post(http, chat_url(gateway, sid), {"model": "m", "messages": messages, "tools": TOOLS})
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"expression": "7+1"}'
    return [*messages, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "8"}]


# ----- malformed calls -------------------------------------------------------------------------------------


def _bad_arguments(good: list[dict[str, Any]]) -> list[dict[str, Any]]:
    answer = json.loads(json.dumps(good[1]))
    answer["tool_calls"][0]["function"]["arguments"] = '{"expression": '
    return [good[0], answer, good[2]]


def _body(**fields: Any) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """A call extending the session correctly, but for ``fields``."""
    return lambda good: {"model": "m", "messages": good, "tools": TOOLS, **fields}


BAD_CALLS: list[tuple[str, Callable[[list[dict[str, Any]]], dict[str, Any]], str]] = [
    # (what is wrong, the request's aiohttp arguments given the good messages, what the message names)
    ("not JSON", lambda good: {"data": b'{"messages": [', "headers": JSON}, "not valid JSON"),
    ("a JSON array", lambda good: {"data": b"[1, 2]", "headers": JSON}, "JSON object"),
    ("no body", lambda good: {"data": b"", "headers": JSON}, "JSON object"),
    ("wrong content type", lambda good: {"data": json.dumps(_body()(good)), "headers": {"Content-Type": "text/plain"}},
     "Content-Type"),
    ("messages missing", lambda good: {"json": {"model": "m", "tools": TOOLS}}, "messages"),
    ("messages empty", lambda good: {"json": _body(messages=[])(good)}, "messages"),
    ("messages not a list", lambda good: {"json": _body(messages={"role": "user", "content": "x"})(good)}, "messages"),
    ("a bad role", lambda good: {"json": _body(messages=[*good, {"role": "robot", "content": "x"}])(good)},
     "messages[3]"),
    ("a message that is text", lambda good: {"json": _body(messages=[*good, "hello"])(good)}, "messages[3]"),
    ("content of the wrong type", lambda good: {"json": _body(messages=[*good, {"role": "user", "content": 5}])(good)},
     "messages[3].content"),
    ("tools not a list", lambda good: {"json": _body(tools=CALCULATOR)(good)}, "tools"),
    ("tools not objects", lambda good: {"json": _body(tools=["calculator"])(good)}, "tools"),
    ("n=2", lambda good: {"json": _body(n=2)(good)}, "n:"),
    ("max_tokens a string", lambda good: {"json": _body(max_tokens="16")(good)}, "max_tokens"),
    ("max_tokens zero", lambda good: {"json": _body(max_tokens=0)(good)}, "max_tokens"),
    ("max_tokens a float", lambda good: {"json": _body(max_tokens=1.5)(good)}, "max_tokens"),
    ("stop not strings", lambda good: {"json": _body(stop=[1])(good)}, "stop"),
    ("tool call arguments not JSON", lambda good: {"json": _body(messages=_bad_arguments(good))(good)},
     "messages[1].tool_calls"),
]  # fmt: skip
SAMPLING_CALLS = [  # with gateway.sampling: request
    ("temperature a string", {"temperature": "hot"}, "temperature"),
    ("temperature negative", {"temperature": -1}, "temperature"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("top_k a float", {"top_k": 2.5}, "top_k"),
    ("seed a string", {"seed": "7"}, "seed"),
]


BadCall = Callable[[list[dict[str, Any]]], dict[str, Any]]
"""The aiohttp arguments of a bad call, given the messages of a good one."""


async def check_bad_call_harms_nothing(gateway: Gateway, http: aiohttp.ClientSession, request: BadCall,
                                       field: str, status: int = 400) -> None:  # fmt: skip
    """A bad call is answered ``status`` naming ``field``, and the next good call still extends the session."""
    sid = await open_session(gateway, http)
    good = await first_call(gateway, http, sid)
    async with http.post(chat_url(gateway, sid), **request(good)) as response:
        error = error_of(response.status, await response.json(content_type=None), status)
    assert field in error["message"] and error["type"] == "invalid_request_error"
    status, answer = await post(http, chat_url(gateway, sid), _body()(good))
    assert status == 200, answer
    assert answer["rallyrl"]["new_sample"] is None and answer["rallyrl"]["turn"] == 2
    assert answer["choices"][0]["message"]["content"] == "task 7: the answer is 8"
    trajectory = await finish(gateway, http, sid)
    assert trajectory["turns"] == 2 and trajectory["segments"] == [] and trajectory["finish_reason"] == "stop"
    assert [m["role"] for m in trajectory["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert trajectory["consistency_diff"] is None


@pytest.mark.parametrize(("what", "request_", "field"), BAD_CALLS, ids=[case[0] for case in BAD_CALLS])
async def test_a_malformed_call_is_400_naming_the_field_and_leaves_the_session_whole(scripted, tokenizer, what,
                                                                                    request_, field):  # fmt: skip
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        await check_bad_call_harms_nothing(gateway, http, request_, field, 415 if what == "wrong content type" else 400)
        assert gateway.counters["calls"] == 2


@pytest.mark.parametrize(("what", "fields", "field"), SAMPLING_CALLS, ids=[c[0] for c in SAMPLING_CALLS])
async def test_a_bad_sampling_value_is_400_when_the_agent_samples(scripted, tokenizer, what, fields, field):
    async with gateway_on(scripted, tokenizer, sampling="request") as (gateway, http):
        await check_bad_call_harms_nothing(gateway, http, lambda good: {"json": _body(**fields)(good)}, field)


async def test_a_sampling_value_of_the_wrong_type_is_400_even_when_the_rollout_samples(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        await check_bad_call_harms_nothing(gateway, http, lambda good: {"json": _body(temperature="hot")(good)},
                                           "temperature")  # fmt: skip


async def test_tool_calls_that_are_not_a_list_are_400(scripted, tokenizer):
    def garbled(good: list[dict[str, Any]]) -> dict[str, Any]:
        return _body(messages=[*good, {"role": "assistant", "content": "x", "tool_calls": "calculator"},
                               {"role": "user", "content": "y"}])(good)  # fmt: skip

    async with gateway_on(scripted, tokenizer) as (gateway, http):
        await check_bad_call_harms_nothing(gateway, http, lambda good: {"json": garbled(good)}, "tool_calls")


@pytest.mark.parametrize("tool", [{"type": "function"}, {"type": "function", "function": {"name": 3}}],
                         ids=["no function", "a name that is not a string"])  # fmt: skip
async def test_a_tool_without_a_function_name_is_400(scripted, tokenizer, tool):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        await check_bad_call_harms_nothing(gateway, http, lambda good: {"json": _body(tools=[tool])(good)}, "tools[0]")


# ----- unknown, finished and too many sessions -------------------------------------------------------------


async def test_an_unknown_session_is_404_by_path_and_by_bearer(scripted, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        for status, answer in [
            await post(http, chat_url(gateway, "sess-nope"), body),
            await post(http, f"{gateway.url}/v1/chat/completions", body, headers={"Authorization": "Bearer sess-nope"}),
            await post(http, f"{gateway.url}/sessions/sess-nope/reward", {"reward": 1}),
            await post(http, f"{gateway.url}/sessions/sess-nope/finish"),
        ]:
            error = error_of(status, answer, 404)
            assert error["code"] == "session_not_found" and "sess-nope" in error["message"]
        async with http.get(f"{gateway.url}/sessions/sess-nope") as response:
            assert error_of(response.status, await response.json(), 404)["code"] == "session_not_found"
        client = openai.AsyncOpenAI(base_url=gateway.base_url("sess-nope"), api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(**body)
        assert caught.value.code == "session_not_found"
        await client.close()
        assert gateway.counters["calls"] == 0 and not gateway.sessions


async def test_a_call_without_a_session_is_404_with_the_hint(scripted, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Basic abc"}):
            status, answer = await post(http, f"{gateway.url}/v1/chat/completions", body, headers=headers)
            message = error_of(status, answer, 404)["message"]
            assert "/sessions/{id}/v1" in message and "Authorization: Bearer" in message and "POST /sessions" in message


async def test_the_bearer_form_records_into_the_named_session(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=sid, max_retries=0)
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await client.close()
        assert reply.choices[0].message.content == "you said: hi"
        assert gateway.sessions[sid].calls == 1


async def test_a_finished_session_is_409_everywhere(scripted, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        assert (await post(http, chat_url(gateway, sid), body))[0] == 200
        trajectory = await finish(gateway, http, sid)
        assert trajectory["finish_reason"] == "stop" and trajectory["turns"] == 1
        for status, answer in [
            await post(http, chat_url(gateway, sid), body),
            await post(http, f"{gateway.url}/v1/chat/completions", body, headers={"Authorization": f"Bearer {sid}"}),
            await post(http, f"{gateway.url}/sessions/{sid}/reward", {"reward": 1}),
            await post(http, f"{gateway.url}/sessions/{sid}/finish"),
        ]:
            assert error_of(status, answer, 409)["code"] == "session_finished"
        async with http.get(f"{gateway.url}/sessions/{sid}") as response:
            kept = await response.json()
        assert kept["state"] == "completed" and kept["trajectory"]["response_ids"] == trajectory["response_ids"]
        assert (await post(http, f"{gateway.url}/sessions", {"session_id": sid}))[0] == 409


async def test_a_bearer_naming_another_session_is_403_and_any_other_key_is_ignored(scripted, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        a, b = await open_session(gateway, http), await open_session(gateway, http)
        status, answer = await post(http, chat_url(gateway, b), body, headers={"Authorization": f"Bearer {a}"})
        error = error_of(status, answer, 403)
        assert error["code"] == "session_mismatch" and a in error["message"] and b in error["message"]
        assert gateway.sessions[a].calls == gateway.sessions[b].calls == 0
        for key in ("unused", b, "sk-not-a-session"):  # a client's own key, or the path's session
            status, answer = await post(http, chat_url(gateway, b), body, headers={"Authorization": f"Bearer {key}"})
            assert status == 200, answer
        await finish(gateway, http, a)  # a finished session is still a session
        mismatched = {"Authorization": f"Bearer {a}"}
        status, answer = await post(http, f"{gateway.url}/sessions/{b}/finish", headers=mismatched)
        assert error_of(status, answer, 403)["code"] == "session_mismatch" and b in gateway.sessions


@pytest.mark.parametrize("sid", ["a?b", "a#b", "a%2Fb", "..", "a..b", "-a", "a/b", "a\r\nb", "a b", "", "x" * 129, 5])
async def test_a_session_id_outside_the_safe_alphabet_is_400(scripted, tokenizer, sid):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        status, answer = await post(http, f"{gateway.url}/sessions", {"session_id": sid})
        error = error_of(status, answer, 400)
        assert error["code"] == "invalid_session_id" and error["message"].startswith("session_id:")
        assert not gateway.sessions
        for fine in ("a", "x" * 128, "run-1.g2:3_4"):
            await open_session(gateway, http, session_id=fine)


async def test_finished_ids_are_remembered_past_keep_finished_up_to_remember_finished(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer, keep_finished=1, remember_finished=3) as (gateway, http):
        sids = [await open_session(gateway, http, session_id=f"s{i}") for i in range(4)]
        for sid in sids:
            await finish(gateway, http, sid)
        assert list(gateway.finished) == ["s3"]
        for sid in ("s1", "s2"):  # no trajectory kept, the id remembered
            status, answer = await post(http, f"{gateway.url}/sessions", {"session_id": sid})
            assert error_of(status, answer, 409)["code"] == "session_exists"
            status, answer = await post(http, chat_url(gateway, sid), {"messages": [{"role": "user", "content": "x"}]})
            assert error_of(status, answer, 409)["code"] == "session_finished"
        assert await open_session(gateway, http, session_id="s0") == "s0"  # the oldest, forgotten


async def test_sessions_opened_in_process_neither_give_way_nor_expire_unused(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer, max_sessions=2, unused_session_timeout_s=0.1) as (gateway, http):
        held = gateway.open_session()  # as AgentDriver opens them: the driver ends it
        await asyncio.sleep(0.3)
        assert held.id in gateway.sessions and gateway.counters["sessions_expired"] == 0
        gateway.open_session()
        status, answer = await post(http, f"{gateway.url}/sessions")
        assert error_of(status, answer, 429)["code"] == "too_many_sessions"


def test_the_chat_cache_keeps_lists_within_its_budget_least_recently_used_first(tokenizer):
    def tools(name: str, size: int) -> tuple[list[dict[str, Any]], str]:
        listed = [{"type": "function", "function": {"name": name, "description": "d" * size}}]
        return listed, json.dumps(listed)

    cache = ChatCache(tokenizer, max_entries=3, max_bytes=4000)
    small = [tools(f"t{i}", 400) for i in range(4)]
    chats = [cache.get(*listed) for listed in small[:3]]
    assert cache.get(*small[0]) is chats[0] and len(cache) == 3  # t0 used again: t1 is the oldest now
    cache.get(*small[3])
    assert len(cache) == 3 and cache.get(*small[0]) is chats[0] and cache.get(*small[1]) is not chats[1]
    big = tools("big", 1500)  # over a quarter of the budget: never kept
    assert cache.get(*big) is not cache.get(*big) and cache.bytes <= 4000
    own = cache.get(*big)
    assert cache.get(*big, own=own) is own


async def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(scripted, tokenizer):
    rollout = RolloutConfig(max_model_len=64)
    async with gateway_on(scripted, tokenizer, rollout) as (gateway, http):
        longest = gateway._longest_token
        sid = await open_session(gateway, http)
        text = "x" * (64 * longest + 1)
        status, answer = await post(http, chat_url(gateway, sid), {"messages": [{"role": "user", "content": text}]})
        error = error_of(status, answer, 400)
        assert error["code"] == "context_length_exceeded" and "characters of text" in error["message"]
        reasoning = {"role": "assistant", "content": "<think>" + text + "</think>ok"}  # dropped by such templates
        status, answer = await post(http, chat_url(gateway, sid), {"messages": [
            {"role": "user", "content": "hi"}, reasoning, {"role": "user", "content": "and?"}]})  # fmt: skip
        assert "characters of text" not in json.dumps(answer)


async def test_two_finishes_at_once_end_the_session_once(scripted, tokenizer):
    finished: list[AsyncRolloutRequest] = []
    async with gateway_on(scripted, tokenizer, on_finish=finished.append) as (gateway, http):
        sid = await open_session(gateway, http)
        await first_call(gateway, http, sid)
        answers = await asyncio.gather(*(post(http, f"{gateway.url}/sessions/{sid}/finish") for _ in range(2)))
        assert sorted(status for status, _ in answers) == [200, 409]
        assert len(finished) == 1 and gateway.counters["sessions_finished"] == 1


async def test_a_finish_waits_for_the_call_in_flight_and_records_it(tokenizer):
    engine = ScriptedEngine(ChatTokenizer(tokenizer, None), calc_script, delay=lambda rid: 0.3)
    async with gateway_on(engine, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        body = {"model": "m", "messages": [{"role": "user", "content": "slow"}]}
        in_flight = asyncio.create_task(post(http, chat_url(gateway, sid), body))
        await asyncio.sleep(0.1)
        trajectory = await finish(gateway, http, sid)
        status, answer = await in_flight
        assert status == 200 and answer["choices"][0]["message"]["content"] == "you said: slow"
        assert trajectory["turns"] == 1 and trajectory["messages"][-1]["content"] == "you said: slow"


async def test_too_many_sessions_that_each_made_a_call_is_429_until_one_finishes(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer, max_sessions=3) as (gateway, http):
        sids = [await open_session(gateway, http) for _ in range(3)]
        for sid in sids:
            await first_call(gateway, http, sid)
        status, answer = await post(http, f"{gateway.url}/sessions")
        error = error_of(status, answer, 429)
        assert error["code"] == "too_many_sessions" and "gateway.max_sessions" in error["message"]
        await finish(gateway, http, sids[0])
        await open_session(gateway, http)
        assert len(gateway.sessions) == 3 and gateway.counters["sessions_evicted"] == 0


async def test_a_full_gateway_ends_the_session_waiting_longest_for_its_first_call(scripted, tokenizer):
    finished: list[AsyncRolloutRequest] = []
    async with gateway_on(scripted, tokenizer, max_sessions=3, on_finish=finished.append) as (gateway, http):
        used = await open_session(gateway, http)
        await first_call(gateway, http, used)
        oldest, newer = await open_session(gateway, http), await open_session(gateway, http)
        newest = await open_session(gateway, http)  # 201: the oldest never-called session gives way
        await asyncio.sleep(0.05)
        assert set(gateway.sessions) == {used, newer, newest} and gateway.counters["sessions_evicted"] == 1
        (evicted,) = finished
        assert evicted.request_id == oldest and evicted.finish_reason.value == "abort"
        assert "gateway.max_sessions (3)" in evicted.error and "never called" in evicted.error
        status, answer = await post(http, chat_url(gateway, oldest), {"messages": [{"role": "user", "content": "x"}]})
        assert error_of(status, answer, 409)["code"] == "session_finished"
        await first_call(gateway, http, newer)
        await first_call(gateway, http, newest)
        status, answer = await post(http, f"{gateway.url}/sessions")  # every open session has made a call
        assert error_of(status, answer, 429)["code"] == "too_many_sessions"


async def test_a_session_opened_and_never_called_expires_after_the_unused_timeout(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer, unused_session_timeout_s=0.2) as (gateway, http):
        unused, used = await open_session(gateway, http), await open_session(gateway, http)
        await first_call(gateway, http, used)
        await asyncio.sleep(0.6)
        assert set(gateway.sessions) == {used} and gateway.counters["sessions_expired"] == 1
        assert "gateway.unused_session_timeout_s" in gateway.finished[unused].error


# ----- rewards -------------------------------------------------------------------------------------------


BAD_REWARDS = [
    ("no body", {"data": b""}, "JSON object"),
    ("not JSON", {"data": b"{reward: 1}", "headers": JSON}, "not valid JSON"),
    ("NaN", {"data": b'{"reward": NaN}', "headers": JSON}, "not valid JSON"),
    ("infinite", {"data": b'{"reward": 1e400}', "headers": JSON}, "not valid JSON"),
    ("a JSON array", {"json": [1.0]}, "JSON object"),
    ("no reward", {"json": {"score": 1.0}}, "reward"),
    ("null", {"json": {"reward": None}}, "reward"),
    ("a string", {"json": {"reward": "1.0"}}, "reward"),
    ("a boolean", {"json": {"reward": True}}, "reward"),
    ("a list", {"json": {"reward": [1.0]}}, "reward"),
]


async def test_bad_rewards_are_400_and_change_nothing(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        await first_call(gateway, http, sid)
        for what, kwargs, field in BAD_REWARDS:
            async with http.post(f"{gateway.url}/sessions/{sid}/reward", **kwargs) as response:
                error = error_of(response.status, await response.json(content_type=None), 400)
            assert field in error["message"], what
            assert gateway.sessions[sid].request.rewards.posted is None, what
        assert (await post(http, f"{gateway.url}/sessions/{sid}/reward", {"reward": 0.25}))[0] == 200
        assert (await post(http, f"{gateway.url}/sessions/{sid}/reward", {"reward": 0.75}))[0] == 200  # the last wins
        for body in ({"reward": "high"}, {"error": 5}):  # a bad finish leaves the session open
            status, answer = await post(http, f"{gateway.url}/sessions/{sid}/finish", body)
            assert error_of(status, answer, 400) and sid in gateway.sessions
        trajectory = await finish(gateway, http, sid)
        assert trajectory["reward"] == 0.75 and trajectory["rewards"]["posted"] == 0.75


async def test_a_reward_given_at_finish_does_not_override_a_posted_one(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        posted, given = await open_session(gateway, http), await open_session(gateway, http)
        for sid in (posted, given):
            await first_call(gateway, http, sid)
        await post(http, f"{gateway.url}/sessions/{posted}/reward", {"reward": -1})
        assert (await finish(gateway, http, posted, reward=1))["reward"] == -1.0
        assert (await finish(gateway, http, given, reward=0.5))["reward"] == 0.5


# ----- clients that walk away ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def embedded_model():
    return load_model(resolve_model(None))


@pytest.fixture(scope="session")
def embedded_tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture
async def embedded(embedded_model) -> AsyncIterator[LocalEngine]:
    """The embedded engine (on CPU), running for one test."""
    async with open_engine(EngineConfig(), resolve_model(None), max_model_len=1024, model=embedded_model) as engine:
        yield engine


class Endless:
    """The embedded engine asked never to stop before ``max_new_tokens`` (no stop tokens), so that a call
    runs long enough for its client to walk away from it; everything else is the engine's own."""

    def __init__(self, engine: LocalEngine):
        self.engine = engine

    @staticmethod
    def _endless(sampling: SamplingParams) -> SamplingParams:
        return dataclasses.replace(sampling, stop_token_ids=[])

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Any:
        return await self.engine.generate(input_ids, self._endless(sampling), rid)

    def generate_stream(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Any:
        return self.engine.generate_stream(input_ids, self._endless(sampling), rid)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        return await self.engine.update_weights(state_dict, weight_version)

    async def abort(self, rid: str | None = None) -> None:
        await self.engine.abort(rid)

    async def health(self) -> bool:
        return await self.engine.health()


LONG = 900  # tokens of the call the client walks away from (seconds of CPU if it were not aborted)
LONG_CALLS = RolloutConfig(max_model_len=1024, max_new_tokens=LONG)


async def engine_idle(engine: LocalEngine, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while engine._waiting or engine._batch.running:  # what "idle" means for the local engine
        assert time.monotonic() < deadline, f"the engine still runs {len(engine._batch.running)} sequences"
        await asyncio.sleep(0.02)


async def walk_away_then_continue(gateway: Gateway, http: aiohttp.ClientSession, engine: LocalEngine,
                                  walk_away: Callable[[str, dict[str, Any]], Any]) -> None:  # fmt: skip
    """One short call, then ``walk_away(url, body)`` abandons a long one: the engine stops generating
    it, the session records nothing of it, and the same call made again extends the session."""
    sid = await open_session(gateway, http)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 12*7?"}]
    status, answer = await post(http, chat_url(gateway, sid), {"model": "m", "messages": messages, "max_tokens": 4})
    assert status == 200, answer
    messages += [answer["choices"][0]["message"], {"role": "user", "content": "And 3+4?"}]
    tokens_before = engine.stats.generated_tokens
    await walk_away(chat_url(gateway, sid), {"model": "m", "messages": messages, "max_tokens": LONG})
    await engine_idle(engine)
    assert engine.stats.generated_tokens - tokens_before < LONG // 2, "the abandoned generation was not aborted"
    session = gateway.sessions[sid]
    assert session.calls == 1 and session.request.metrics.turns == 1 and not session.lock.locked()
    assert len(session.request.response_ids) == 4
    status, answer = await post(http, chat_url(gateway, sid), {"model": "m", "messages": messages, "max_tokens": 4})
    assert status == 200 and answer["rallyrl"]["new_sample"] is None and answer["rallyrl"]["turn"] == 2, answer
    trajectory = await finish(gateway, http, sid)
    assert trajectory["turns"] == 2 and trajectory["segments"] == [] and trajectory["consistency_diff"] is None
    assert trajectory["loss_mask"].count(1) == 8


async def test_a_stream_abandoned_mid_answer_is_aborted_and_records_nothing(embedded, embedded_tokenizer, caplog):
    async def read_two_chunks_and_close(url: str, body: dict[str, Any]) -> None:
        response = await http.post(url, json={**body, "stream": True})
        chunks = 0
        async for line in response.content:
            chunks += line.startswith(b"data: ")
            if chunks == 3:  # the role, then two pieces of text
                break
        response.close()  # drops the connection
        assert chunks == 3

    caplog.set_level(logging.ERROR, logger="rollout.gateway")
    async with gateway_on(Endless(embedded), embedded_tokenizer, LONG_CALLS) as (gateway, http):
        await walk_away_then_continue(gateway, http, embedded, read_two_chunks_and_close)
    assert not caplog.records, "a client that goes away is not a gateway failure"


async def test_a_call_whose_client_times_out_is_aborted_and_records_nothing(embedded, embedded_tokenizer):
    async def time_out(url: str, body: dict[str, Any]) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=0.2))

    async with gateway_on(Endless(embedded), embedded_tokenizer, LONG_CALLS) as (gateway, http):
        await walk_away_then_continue(gateway, http, embedded, time_out)


async def test_an_openai_client_that_gives_up_leaves_the_session_usable(embedded, embedded_tokenizer):
    async def give_up(url: str, body: dict[str, Any]) -> None:
        client = openai.AsyncOpenAI(base_url=url.removesuffix("/chat/completions"), api_key="x", max_retries=0,
                                    timeout=0.2)  # fmt: skip
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(**body)
        await client.close()

    async with gateway_on(Endless(embedded), embedded_tokenizer, LONG_CALLS) as (gateway, http):
        await walk_away_then_continue(gateway, http, embedded, give_up)


async def test_an_agent_that_vanishes_is_expired_after_session_timeout(tokenizer):
    engine = ScriptedEngine(ChatTokenizer(tokenizer, None), calc_script,
                            delay=lambda rid: 1.0 if "slow" in rid else 0.0)  # fmt: skip
    finished: list[AsyncRolloutRequest] = []
    async with gateway_on(engine, tokenizer, session_timeout_s=0.4, on_finish=finished.append) as (gateway, http):
        idle, silent = await open_session(gateway, http), await open_session(gateway, http)
        busy = await open_session(gateway, http, session_id="slow-session")
        await first_call(gateway, http, idle)
        status, answer = await post(http, chat_url(gateway, busy),  # a call longer than the timeout is not expired
                                    {"model": "m", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert status == 200 and answer["choices"][0]["message"]["content"] == "you said: hi"
        assert idle not in gateway.sessions and silent not in gateway.sessions and busy in gateway.sessions
        await asyncio.sleep(1.0)
        assert not gateway.sessions and gateway.counters["sessions_expired"] == 3
        by_id = {r.request_id: r for r in finished}
        assert set(by_id) == {idle, silent, busy}
        for request in by_id.values():
            assert request.finish_reason.value == "abort" and "no call for 0.4 s" in request.error
        assert by_id[idle].metrics.turns == 1 and by_id[busy].metrics.turns == 1 and by_id[silent].metrics.turns == 0
        status, answer = await post(http, chat_url(gateway, idle), {"messages": [{"role": "user", "content": "hi"}]})
        assert error_of(status, answer, 409)["code"] == "session_finished"


# ----- engine failures -------------------------------------------------------------------------------------


async def test_an_engine_error_is_502_and_the_session_goes_on(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        good = await first_call(gateway, http, sid)
        status, answer = await post(http, chat_url(gateway, sid),
                                    _body(messages=[*good[:2], {**good[2], "content": "EXPLODE"}])(good))  # fmt: skip
        error = error_of(status, answer, 502)
        assert "the engine blew up" in error["message"]
        status, answer = await post(http, chat_url(gateway, sid), _body()(good))
        assert status == 200 and answer["rallyrl"]["new_sample"] is None


async def test_an_engine_error_in_a_stream_is_an_error_event(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        body = {"model": "m", "messages": [{"role": "user", "content": "EXPLODE"}], "stream": True}
        async with http.post(chat_url(gateway, sid), json=body) as response:
            events = [line[6:].strip() async for line in response.content if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        assert "the engine blew up" in json.loads(events[-2])["error"]["message"]
        client = openai.AsyncOpenAI(base_url=gateway.base_url(sid), api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="the engine blew up"):
            async for _ in await client.chat.completions.create(**body):
                pass
        await client.close()
        assert (await post(http, chat_url(gateway, sid), {**body, "messages": [{"role": "user", "content": "ok"}],
                                                          "stream": False}))[0] == 200  # fmt: skip


class AbortingEngine(ScriptedEngine):
    """The scripted engine, but a prompt that says ABORT is aborted part-way (a weight update, a pause)."""

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        if "ABORT" in self.chat.decode(input_ids):
            return Generation(self.chat.encode("half an ans"), [-0.1] * 11, "abort", self.weight_version)
        return await super().generate(input_ids, sampling, rid)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_engine_abort_is_503_and_records_nothing(tokenizer, stream):
    engine = AbortingEngine(ChatTokenizer(tokenizer, None), calc_script)
    async with gateway_on(engine, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        good = await first_call(gateway, http, sid)
        body = _body(messages=[*good[:2], {**good[2], "content": "ABORT"}], stream=stream)(good)
        async with http.post(chat_url(gateway, sid), json=body) as response:
            if stream:
                events = [line[6:].strip() async for line in response.content if line.startswith(b"data: ")]
                assert events[-1] == b"[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_aborted"
            else:
                assert error_of(response.status, await response.json(), 503)["code"] == "engine_aborted"
        assert gateway.sessions[sid].calls == 1 and gateway.sessions[sid].request.metrics.turns == 1
        status, answer = await post(http, chat_url(gateway, sid), _body()(good))
        assert status == 200 and answer["rallyrl"]["new_sample"] is None and answer["rallyrl"]["turn"] == 2


# ----- spent budgets ---------------------------------------------------------------------------------------


async def test_a_call_past_max_turns_is_400_and_the_session_ends_max_turns(scripted, tokenizer):
    async with gateway_on(scripted, tokenizer, rollout=RolloutConfig(max_turns=1)) as (gateway, http):
        sid = await open_session(gateway, http)
        good = await first_call(gateway, http, sid)
        async with openai.AsyncOpenAI(base_url=gateway.base_url(sid), api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=good, tools=TOOLS)
        assert caught.value.code == "max_turns_exceeded" and "rollout.max_turns" in caught.value.message
        trajectory = await finish(gateway, http, sid)
        assert trajectory["finish_reason"] == "max_turns" and trajectory["turns"] == 1


async def test_a_conversation_past_the_context_is_400_context_length_exceeded(scripted, tokenizer):
    rollout = RolloutConfig(max_model_len=400, max_new_tokens=64)
    async with gateway_on(scripted, tokenizer, rollout=rollout) as (gateway, http):
        sid = await open_session(gateway, http)
        body = {"model": "m", "messages": [{"role": "user", "content": "task 1: " + "very long " * 60}]}
        error = error_of(*await post(http, chat_url(gateway, sid), body), 400)
        assert error["code"] == "context_length_exceeded" and "rollout.max_model_len 400" in error["message"]
        status, answer = await post(
            http, chat_url(gateway, sid), {**body, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200 and answer["rallyrl"]["turn"] == 1  # a shorter conversation still fits


# ----- a thousand sessions at once -------------------------------------------------------------------------


async def test_a_thousand_sessions_at_once_each_record_only_their_own_conversation(tokenizer):
    count, keep = 1000, 50
    engine = ScriptedEngine(ChatTokenizer(tokenizer, None), calc_script, delay=random_delay(1))
    finished: list[AsyncRolloutRequest] = []

    async def agent(i: int, sid: str) -> dict[str, Any]:
        """Two calls (by path or by bearer), a reward for the odd ones, then the finish."""
        url, headers = (chat_url(gateway, sid), {}) if i % 2 else (f"{gateway.url}/v1/chat/completions",
                                                                   {"Authorization": f"Bearer {sid}"})  # fmt: skip
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {i}: add one"}]
        status, answer = await post(http, url, {"model": "m", "messages": messages, "tools": TOOLS}, headers=headers)
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        result = str(i + 1)
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result}]
        status, answer = await post(http, url, {"model": "m", "messages": messages, "tools": TOOLS}, headers=headers)
        assert status == 200 and answer["choices"][0]["message"]["content"] == f"task {i}: the answer is {result}"
        if i % 2:
            assert (await post(http, f"{gateway.url}/sessions/{sid}/reward", {"reward": i / count}))[0] == 200
        return await finish(gateway, http, sid)

    serving = gateway_on(engine, tokenizer, limit=128, keep_finished=keep, on_finish=finished.append)
    async with serving as (gateway, http):
        sids = await asyncio.gather(*(open_session(gateway, http, metadata={"task": i}) for i in range(count)))
        assert len(gateway.sessions) == count
        trajectories = await asyncio.gather(*(agent(i, sid) for i, sid in enumerate(sids)))
        assert not gateway.sessions and len(gateway.finished) == keep and len(finished) == count
        assert gateway.counters["sessions_finished"] == count and gateway.counters["calls"] == 2 * count
        assert len(gateway._chats) == 1  # one cached template for the one tool list

    chat = ChatTokenizer(tokenizer, TOOLS)
    for i, (sid, trajectory) in enumerate(zip(sids, trajectories, strict=True)):
        text = chat.decode(trajectory["prompt_ids"] + trajectory["response_ids"])
        assert set(re.findall(r"task (\d+)", text)) == {str(i)}, f"session {i} saw another session's task"
        assert trajectory["messages"][0]["content"] == f"task {i}: add one"
        assert trajectory["messages"][-1]["content"] == f"task {i}: the answer is {i + 1}"
        calls = [(c["name"], c["arguments"]) for c in trajectory["tool_calls"]]
        assert calls == [("calculator", {"expression": f"{i}+1"})]
        rids = sorted((rid for rid in engine.emitted if rid.startswith(f"{sid}-")), key=lambda r: int(r.split("-")[-2]))
        sampled = [t for rid in rids for t in engine.emitted[rid]]
        assert [t for t, m in zip(trajectory["response_ids"], trajectory["loss_mask"], strict=True) if m] == sampled
        assert trajectory["turns"] == 2 and trajectory["segments"] == [] and trajectory["consistency_diff"] is None
        assert trajectory["reward"] == (i / count if i % 2 else 0.0)


# ----- streams -------------------------------------------------------------------------------------------


def reassemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message an OpenAI client builds from a stream's chunks, and the finish reason."""
    content, calls, finish_reason = "", {}, None
    for event in events:
        choice = event["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            call_ = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            call_["name"] += piece["function"].get("name") or ""
            call_["arguments"] += piece["function"].get("arguments") or ""
        finish_reason = choice["finish_reason"] or finish_reason
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish": finish_reason}


def as_answer(answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in choice["message"].get("tool_calls") or []]  # fmt: skip
    return {"content": choice["message"]["content"] or None, "tool_calls": calls, "finish": choice["finish_reason"]}


async def stream_and_answer(gateway: Gateway, http: aiohttp.ClientSession,
                            body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """The same call made streamed in one session and whole in another: the stream's chunks, the answer."""
    streamed, whole = await open_session(gateway, http), await open_session(gateway, http)
    async with http.post(chat_url(gateway, streamed), json={**body, "stream": True}) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        lines = [line[6:].strip() async for line in response.content if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    status, answer = await post(http, chat_url(gateway, whole), body)
    assert status == 200, answer
    return [json.loads(line) for line in lines[:-1]], answer


async def test_a_streamed_tool_call_reassembles_to_the_whole_answer(scripted, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "task 3: add one"}], "tools": TOOLS}
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        events, answer = await stream_and_answer(gateway, http, body)
    assert reassemble(events) == as_answer(answer) == {
        "content": "Let me compute task 3.", "finish": "tool_calls",
        "tool_calls": [{"name": "calculator", "arguments": '{"expression": "3+1"}'}],
    }  # fmt: skip
    assert events[-1]["usage"] == answer["usage"]


async def test_a_streamed_answer_of_the_embedded_model_reassembles_to_the_whole_answer(embedded, embedded_tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 12*7?"}], "max_tokens": 60}
    async with gateway_on(embedded, embedded_tokenizer, RolloutConfig(temperature=0)) as (gateway, http):
        events, answer = await stream_and_answer(gateway, http, body)
        assert reassemble(events) == as_answer(answer)
        assert sum(bool(e["choices"][0]["delta"].get("content")) for e in events) >= 3, "the text came in one piece"
        text = answer["choices"][0]["message"]["content"]
        stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string in the middle of the answer
        events, answer = await stream_and_answer(gateway, http, {**body, "stop": [stop]})
        assert reassemble(events) == as_answer(answer) and answer["choices"][0]["finish_reason"] == "stop"
        assert answer["choices"][0]["message"]["content"] == text[: text.find(stop)]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["text", "tools"])
async def test_the_openai_sdk_streams_what_it_gets_whole(scripted, tokenizer, tools):
    messages = [{"role": "user", "content": "task 12: add one"}]
    extra = {"tools": tools} if tools else {}
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        streamed, whole = await open_session(gateway, http), await open_session(gateway, http)
        async with openai.AsyncOpenAI(base_url=gateway.base_url(streamed), api_key="x", max_retries=0) as client:
            chunks = [chunk.model_dump(exclude={"rallyrl"}) async for chunk in await client.chat.completions.create(
                model="m", messages=messages, stream=True, **extra)]  # fmt: skip
        async with openai.AsyncOpenAI(base_url=gateway.base_url(whole), api_key="x", max_retries=0) as client:
            reply = await client.chat.completions.create(model="m", messages=messages, **extra)
    assert reassemble(chunks) == as_answer(reply.model_dump(exclude={"rallyrl"}))
    assert reply.choices[0].finish_reason == ("tool_calls" if tools else "stop")


async def test_the_calc_agent_streaming_through_the_sdk_extends_its_session(scripted, tokenizer):
    """The agent's loop with ``stream=True``: what it rebuilds from the chunks extends the session."""
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "task 41: add one"}]
        async with openai.AsyncOpenAI(base_url=gateway.base_url(sid), api_key="x", max_retries=0) as client:
            for _ in range(2):
                events = [c.model_dump(exclude={"rallyrl"}) async for c in await client.chat.completions.create(
                    model="m", messages=messages, tools=TOOLS, stream=True)]  # fmt: skip
                got = reassemble(events)
                ids = [e["choices"][0]["delta"]["tool_calls"][0]["id"] for e in events
                       if e["choices"][0]["delta"].get("tool_calls")]  # fmt: skip
                message: dict[str, Any] = {"role": "assistant", "content": got["content"]}
                if got["tool_calls"]:
                    message["tool_calls"] = [{"id": ids[0], "type": "function", "function": got["tool_calls"][0]}]
                messages.append(message)
                if got["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": ids[0], "content": "42"})
        assert messages[-1]["content"] == "task 41: the answer is 42"
        trajectory = await finish(gateway, http, sid)
        assert trajectory["turns"] == 2 and trajectory["segments"] == [] and trajectory["consistency_diff"] is None
        assert trajectory["tool_calls"][0]["text"] == "42"


async def test_an_sdk_answer_dumps_without_warnings(scripted, tokenizer):
    """``metadata`` is OpenAI's field of string values: agents that ``model_dump()`` the reply (LangChain
    does) must not warn on every call."""
    async with gateway_on(scripted, tokenizer) as (gateway, http):
        sid = await open_session(gateway, http)
        async with openai.AsyncOpenAI(base_url=gateway.base_url(sid), api_key="x", max_retries=0) as client:
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reply.model_dump()
