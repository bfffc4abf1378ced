"""``rallyrl gateway`` under hostile HTTP (issue 42): one real gateway process on loopback (the embedded
model, greedy) meets each attack of ``ATTACKS``. Each must get its documented refusal (the field or cap
named, never a 500 traceback), ``/health`` must answer within 100 ms during and after it, a normal agent
call made meanwhile must get the same answer and tokens as before any attack, and the gateway's RSS must
come back within 50 MiB of its level before the attack (``hostile_harness.py``; ``rallyrl serve``'s
attacks are in ``test_hostile_http_serve.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hostile_harness import Attack, HealthProbe, attack_until_fast, check, post, request

ROOT = Path(__file__).resolve().parents[1]
KEEP_FINISHED = 4
UNUSED_TIMEOUT_S = 2.0
MAX_SESSIONS = 4096  # the default
FLAGS = ["--temperature", "0", "--set", f"gateway.keep_finished={KEEP_FINISHED}",
         "--set", f"gateway.unused_session_timeout_s={UNUSED_TIMEOUT_S}"]  # fmt: skip
CHAT = [{"role": "user", "content": "Calculate 12 + 30."}]
NORMAL = {"model": "m", "messages": CHAT, "max_tokens": 24, "logprobs": True}
JSON = {"Content-Type": "application/json"}


# ----- the gateway process ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[tuple[str, int, HealthProbe]]:
    """``rallyrl gateway --port 0`` (its URL read from what it prints), its pid, and a ``/health`` probe."""
    logs = tmp_path_factory.mktemp("hostile-gateway")
    command = [sys.executable, "-m", "cli", "gateway", "--port", "0", "--out", str(logs / "sessions.jsonl"), *FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    log = logs / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (found := re.search(r"on (http://127\.0\.0\.1:\d+)", " ".join(log.read_text().split()))) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"rallyrl gateway printed no URL:\n{log.read_text()}")
            time.sleep(0.2)
        probe = HealthProbe(found.group(1), logs)
        try:
            yield found.group(1), process.pid, probe
        finally:
            probe.close()
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        if process.poll() is None:
            process.kill()


async def open_session(session: aiohttp.ClientSession, url: str, **body: Any) -> str:
    status, text = await post(session, f"{url}/sessions", body)
    assert status == 201, text
    return orjson.loads(text)["session_id"]


async def normal_call(session: aiohttp.ClientSession, url: str) -> tuple[str, list[str], int]:
    """An agent's session: one greedy call, then finished; its answer, tokens and token count."""
    sid = await open_session(session, url)
    status, text = await post(session, f"{url}/sessions/{sid}/v1/chat/completions", NORMAL)
    assert status == 200, text
    answer = orjson.loads(text)
    status, finished = await post(session, f"{url}/sessions/{sid}/finish", {})
    assert status == 200, finished
    choice = answer["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    return choice["message"]["content"], tokens, answer["usage"]["completion_tokens"]


# ----- the attacks ----------------------------------------------------------------------------------------------


def call(body: dict[str, Any], bearer: str | None = None, **session_fields: Any) -> Any:
    """A chat call with ``body`` in a session of its own (opened with ``session_fields``)."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        sid = await open_session(session, url, **session_fields)
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        return await post(session, f"{url}/sessions/{sid}/v1/chat/completions", body, headers=headers)

    return send


def raw(method: str, path: str, data: bytes = b"{}", headers: dict[str, str] | None = None) -> Any:
    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        target = path.replace("{sid}", await open_session(session, url)) if "{sid}" in path else path
        return await request(session, method, url + target, data=data, headers=headers or {}, timeout_s=30)

    return send


def open_with(body: dict[str, Any] | bytes) -> Any:
    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        if isinstance(body, bytes):
            return await request(session, "POST", f"{url}/sessions", data=body, headers=JSON, timeout_s=30)
        return await post(session, f"{url}/sessions", body)

    return send


def chunked(size: int) -> Any:
    """A chat call sent without a length, longer than ``gateway.max_body_mb``."""

    async def chunks() -> Any:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(size // 2**20):
            yield b"x" * 2**20
        yield b'"}]}'

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        sid = await open_session(session, url)
        return await request(session, "POST", f"{url}/sessions/{sid}/v1/chat/completions", data=chunks(),
                             headers=JSON, timeout_s=30)  # fmt: skip

    return send


def tools(count: int, tag: str = "", size: int = 1000) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"tool{tag}_{i}", "description": "d" * size,
                                              "parameters": {"type": "object"}}} for i in range(count)]  # fmt: skip


def tool_lists(count: int) -> Any:
    """``count`` calls with different ~480 KB tool lists (under the cap), each session finished after: the
    chat tokenizer of each (13 times the size of its tools) must not be kept for every list."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        answers = []
        for k in range(count):
            sid = await open_session(session, url)
            answers.append(await post(session, f"{url}/sessions/{sid}/v1/chat/completions",
                                      {"messages": CHAT, "tools": tools(450, f"{k}_")}))  # fmt: skip
            await post(session, f"{url}/sessions/{sid}/finish", {})
        assert len({status for status, _ in answers}) == 1, answers
        return answers[-1]

    return send


def enum_tools(tag: int, values: int = 20_000) -> list[dict[str, Any]]:
    """A tool list of ~110 KB of JSON that is mostly numbers: few characters of strings (it passes the
    check that the text can fit the context), so it is rendered and tokenized before it is refused."""
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "enum": list(range(tag, tag + values))}}}
    return [{"type": "function", "function": {"name": f"pick{tag}", "parameters": parameters}}]


def many_tool_lists(count: int) -> Any:
    """``count`` calls, each with a tool list of its own that is rendered (``enum_tools``): the chat
    tokenizers (13 times the size of their tools each) must not all be kept."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        answers = [await call({"messages": CHAT, "tools": enum_tools(k)})(session, url) for k in range(count)]
        assert len({status for status, _ in answers}) == 1, answers[:2]
        return answers[-1]

    return send


def abandoned_sessions(count: int) -> Any:
    """``count`` sessions opened and never called, then one more open by another client: it gets its session."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        gate = asyncio.Semaphore(64)

        async def one() -> None:
            async with gate:
                await open_session(session, url)

        await asyncio.gather(*(one() for _ in range(count)))
        status, text = await post(session, f"{url}/sessions", {})
        sessions = json.loads((await request(session, "GET", f"{url}/sessions"))[1])
        # room was made by evicting the oldest unused sessions at the cap, or, where opening them all took
        # longer than gateway.unused_session_timeout_s (a loaded machine), by their expiry
        assert sessions["open"] <= MAX_SESSIONS, sessions
        assert sessions["sessions_evicted"] + sessions["sessions_expired"] >= 1, sessions
        return status, text

    return send


def bearer_mismatch() -> Any:
    """Session A's id as the API key, session B in the path."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        a, b = await open_session(session, url), await open_session(session, url)
        status, text = await post(session, f"{url}/sessions/{b}/v1/chat/completions", NORMAL,
                                  headers={"Authorization": f"Bearer {a}"})  # fmt: skip
        assert a in text and b in text, text
        return status, text

    return send


def finished_id_reused(reopen: bool) -> Any:
    """A session finished, then ``KEEP_FINISHED + 2`` newer ones: its id is opened again, or called."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        first = await open_session(session, url)
        await post(session, f"{url}/sessions/{first}/finish", {})
        for _ in range(KEEP_FINISHED + 2):
            sid = await open_session(session, url)
            await post(session, f"{url}/sessions/{sid}/finish", {})
        if reopen:
            return await post(session, f"{url}/sessions", {"session_id": first})
        return await post(session, f"{url}/sessions/{first}/v1/chat/completions", NORMAL)

    return send


def answered_with(check_answer: Any, body: dict[str, Any]) -> Any:
    """A call answered 200 whose answer must pass ``check_answer`` (a clamp rather than a refusal)."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        status, text = await call(body)(session, url)
        if status == 200:
            check_answer(orjson.loads(text))
        return status, text

    return send


def at_most_max_new_tokens(answer: dict[str, Any]) -> None:
    assert answer["usage"]["completion_tokens"] <= 256  # rollout.max_new_tokens


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def with_tool_call(arguments: Any, function: Any = None) -> dict[str, Any]:
    function = {"name": "calc", "arguments": arguments} if function is None else function
    tool_call = {"id": "c1", "type": "function", "function": function}
    answer = {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    return {"messages": [*CHAT, answer, {"role": "tool", "tool_call_id": "c1", "content": "42"}], "max_tokens": 4}


BIG_TEXT = "1+2 " * 975_000  # 3.9 MB: under gateway.max_history_bytes, far over the context

# fmt: off
ATTACKS: dict[str, Attack] = {
    # 1. one request takes the gateway down
    "n 10**9": Attack(1, call({**NORMAL, "n": 10**9}), 400, ("n:",)),
    "max_tokens 10**12": Attack(1, answered_with(at_most_max_new_tokens, {"messages": CHAT, "max_tokens": 10**12}),
                                200, ('"completion_tokens"',)),
    "a 3.9 MB message": Attack(1, call({"messages": [{"role": "user", "content": BIG_TEXT}]}), 400,
                               ("context_length_exceeded", "rollout.max_model_len")),
    "a 3.9 MB answer in the history": Attack(1, call({"messages": [*CHAT, {"role": "assistant", "content": BIG_TEXT},
                                                                  {"role": "user", "content": "and?"}]}), 400,
                                             ("context_length_exceeded",)),
    "a 15 MB history": Attack(1, call({"messages": [{"role": "user", "content": "x" * 15 * 2**20}]}), 413,
                              ("gateway.max_history_bytes", "call_too_large")),
    "a 4.2 MB history": Attack(1, call({"messages": [{"role": "user", "content": "x" * (4 * 2**20 + 2**17)}]}), 413,
                               ("gateway.max_history_bytes", "history_too_large")),
    "5,000 messages": Attack(1, call({"messages": CHAT * 5000}), 400, ("gateway.max_messages",)),
    "100,000 messages": Attack(1, call({"messages": [{"role": "user", "content": "x"}] * 100_000}), 413,
                               ("gateway.max_json_items",)),
    "a million empty lists": Attack(1, call({"messages": CHAT, "padding": [[]] * 1_000_000}), 413,
                                    ("gateway.max_json_items",)),
    "100,000 stop strings": Attack(1, call({"messages": CHAT, "stop": ["x"] * 100_000}), 400, ("stop:",)),
    # 3. memory pinned after the fact
    "twelve different 480 KB tool lists": Attack(3, tool_lists(12), 400, ("context_length_exceeded",)),
    "64 different 110 KB tool lists that are rendered": Attack(3, many_tool_lists(64), 400,
                                                               ("context_length_exceeded", "tokens")),
    "a 1 MB tool list": Attack(3, call({"messages": CHAT, "tools": tools(1000)}), 413,
                               ("gateway.max_tools_bytes", "tools_too_large")),
    "3 MB of session metadata": Attack(3, open_with({"metadata": {"x": ["y" * 100] * 30_000}}), 413,
                                       ("gateway.max_metadata_bytes",)),
    "60 KB of metadata and a 20 KB ground_truth": Attack(3, open_with({"metadata": {"x": "y" * 60_000},
                                                                       "ground_truth": "z" * 20_000}), 413,
                                                         ("gateway.max_metadata_bytes",)),
    f"{MAX_SESSIONS} sessions opened and never called": Attack(3, abandoned_sessions(MAX_SESSIONS), 201,
                                                               ("session_id",)),
    "a 40 MB call without a length": Attack(3, chunked(40 * 2**20), 413, ("gateway.max_history_bytes",)),
    # 4. malformed input
    "a content part whose text is a number": Attack(4, call({"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}), 400, ("messages[0].content",)),
    "tool-call arguments nested 1,000 deep": Attack(4, call(with_tool_call('{"a":' * 1000 + "1" + "}" * 1000)), 400,
                                                    ("messages[1].tool_calls",)),
    "tool-call arguments an object nested 500 deep": Attack(4, call(with_tool_call(nested(500))), 400,
                                                            ("messages[1].tool_calls", "arguments")),
    "a tool call whose function is a string": Attack(4, call(with_tool_call(None, "calc")), 400,
                                                     ("messages[1].tool_calls",)),
    "tools nested 500 deep": Attack(4, call({"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": nested(500)}}]}), 400, ("tools:", "nested")),
    "metadata nested 300 deep": Attack(4, open_with({"metadata": nested(300)}), 400, ("metadata:", "nested")),
    "a seed of 2**64": Attack(4, call({**NORMAL, "seed": 2**64}), 400, ("seed:",)),
    "a body that is a JSON list": Attack(4, raw("POST", "/sessions/{sid}/v1/chat/completions", b"[1]", JSON), 400,
                                         ("JSON object",)),
    # 6. reachable from a web page
    "Host: evil.com": Attack(6, raw("POST", "/sessions", b"{}", {"Host": "evil.com", **JSON}), 403,
                             ("loopback", "host_not_allowed")),
    "a cross-origin POST /sessions": Attack(6, raw("POST", "/sessions", b"{}", {"Origin": "http://evil.com", **JSON}),
                                            403, ("cross-origin",)),
    "a cross-site call": Attack(6, raw("POST", "/sessions/{sid}/v1/chat/completions", orjson.dumps(NORMAL),
                                       {"Sec-Fetch-Site": "cross-site", **JSON}), 403, ("other sites",)),
    "a text/plain POST /sessions": Attack(6, raw("POST", "/sessions", b"{}", {"Content-Type": "text/plain"}), 415,
                                          ("application/json",)),
    "a form POST /sessions/{id}/finish": Attack(6, raw("POST", "/sessions/{sid}/finish", b"reward=1",
                                                       {"Content-Type": "application/x-www-form-urlencoded"}), 415,
                                                ("application/json",)),
    "a 20 MB body by Content-Length": Attack(6, raw("POST", "/sessions/{sid}/v1/chat/completions", b"{}" * 8,
                                                    {"Content-Length": str(20 * 2**20), **JSON}), 413,
                                             ("gateway.max_body_mb",)),
    "OPTIONS /sessions": Attack(6, raw("OPTIONS", "/sessions", b""), 405, ("not allowed",)),
    "TRACE /v1/chat/completions": Attack(6, raw("TRACE", "/v1/chat/completions", b""), 405, ("not allowed",)),
    "PUT /sessions/{id}/finish": Attack(6, raw("PUT", "/sessions/{sid}/finish", b"{}", JSON), 405, ("not allowed",)),
    "DELETE /sessions/{id}": Attack(6, raw("DELETE", "/sessions/{sid}", b""), 405, ("not allowed",)),
    # 7. gateway sessions
    "session A's key with session B's path": Attack(7, bearer_mismatch(), 403, ("session_mismatch",)),
    "a finished id opened again": Attack(7, finished_id_reused(reopen=True), 409, ("session_exists",)),
    "a finished id called again": Attack(7, finished_id_reused(reopen=False), 409, ("session_finished",)),
    **{f"session id {sid!r}": Attack(7, open_with({"session_id": sid}), 400, ("session_id",))
       for sid in ("a?b", "a#b", "a%2Fb", "..", "a/b", "a\r\nb", "a b", "x" * 129)},
}
# fmt: on


@pytest.fixture(scope="module")
def reference(gateway) -> tuple[str, list[str], int]:
    """The normal call's answer before any attack, after a warm-up of the largest work attacked (so that
    RSS before each attack includes what a first large call legitimately keeps: the worker threads'
    arenas, the chat template's compiled code)."""
    url, _, _ = gateway

    async def warm() -> tuple[str, list[str], int]:
        async with aiohttp.ClientSession() as session:
            await call({"messages": CHAT, "tools": tools(20, "warm"), "max_tokens": 4})(session, url)
            await call({"messages": [{"role": "user", "content": "x" * 2**20}]})(session, url)
            return await normal_call(session, url)

    return asyncio.run(warm())


@pytest.mark.parametrize("name", ATTACKS)
async def test_the_gateway_refuses_the_attack_and_serves_on(gateway, reference, name):
    attack, (url, pid, probe) = ATTACKS[name], gateway
    outcome = await attack_until_fast(url, pid, probe, attack, lambda session: normal_call(session, url))
    check(outcome, attack, reference)


def test_the_attacks_cover_the_gateway_classes():
    assert len(ATTACKS) >= 20
    assert {attack.kind for attack in ATTACKS.values()} == {1, 3, 4, 6, 7}
