"""``rallyrl serve`` under hostile HTTP (issue 42): one real server process on loopback (the embedded
model, no key, as documented) meets each attack of ``ATTACKS``. Each must get its documented refusal
(the field or limit named, never a 500 traceback), ``/health`` must answer within 100 ms during and
after it, a greedy request sent meanwhile must get the same tokens as before any attack, and the
server's RSS must come back within 50 MiB of its level before the attack (``hostile_harness.py``).
The gateway's attacks are in ``test_gateway_hostile_http.py``."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import aiohttp
import orjson
import pytest
from hostile_harness import Attack, HealthProbe, attack_until_fast, check, post, request

from data.tiny_model import EMBEDDED_MODEL
from rollout.serve.processes import serve_processes

NORMAL = {"text": "What is 3+4?", "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}
CHAT = [{"role": "user", "content": "hi"}]
FAR = 10**9


def generate(body: dict, path: str = "/generate", **kwargs) -> object:
    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        return await post(session, url + path, body, **kwargs)

    return send


def raw(method: str, path: str, data: bytes = b"{}", headers: dict | None = None) -> object:
    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        return await request(session, method, url + path, data=data, headers=headers or {}, timeout_s=30)

    return send


def sampling(**params) -> dict:
    return {"text": "1+1=", "sampling_params": {"max_new_tokens": 4, **params}}


def call_with_arguments(arguments: object) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": arguments}}
    return {"messages": [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]}], "max_tokens": 2}


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def burst(count: int, tokens: int) -> object:
    """``count`` prompts of ``tokens`` tokens at once (the KV buffer grows to hold them)."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        body = {"input_ids": [[5 + i % 90 for i in range(j, j + tokens)] for j in range(count)],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        return await post(session, url + "/generate", body)

    return send


def dropped_streams(count: int) -> object:
    """``count`` streams whose clients hang up after the first chunk."""

    async def one(session: aiohttp.ClientSession, url: str, i: int) -> None:
        body = {"input_ids": [[7 + i % 50] * 300], "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        async with session.post(url + "/generate", json=body) as response:
            await response.content.readline()
            response.close()

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        await asyncio.gather(*(one(session, url, i) for i in range(count)))
        return 200, "dropped"

    return send


def flood(count: int) -> object:
    """``count`` requests at once, each a few tokens long."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        answers = await asyncio.gather(*(post(session, url + "/generate", sampling(max_new_tokens=8, sampling_seed=i))
                                         for i in range(count)))  # fmt: skip
        bad = [answer for answer in answers if answer[0] != 200]
        return (bad[0] if bad else (200, f"{count} answered"))

    return send


def chunked_body(size: int) -> object:
    """A body sent without a length, longer than the limit."""

    async def chunks():
        piece = b" " * 2**20
        yield b'{"text": "'
        for _ in range(size // len(piece)):
            yield piece
        yield b'"}'

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        try:
            return await request(session, "POST", url + "/generate", data=chunks(),
                                 headers={"Content-Type": "application/json"})
        except aiohttp.ClientError as exc:  # the server may close the connection as it refuses
            return 413, f"closed: {exc!r} body_too_large"

    return send


def weights_from(make_path) -> object:
    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        body = {"model_path": str(make_path()), "weight_version": "evil"}
        return await post(session, url + "/update_weights_from_disk", body, timeout_s=20)

    return send


ROOT = Path(os.environ.get("PYTEST_HOSTILE_ROOT", "/tmp")) / f"rallyrl-hostile-{os.getpid()}"
ALLOWED = ROOT / "weights"


def fifo_model() -> Path:
    directory = ALLOWED / "fifo"
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "model.safetensors").exists():
        os.mkfifo(directory / "model.safetensors")
    return directory


def not_a_model() -> Path:
    directory = ALLOWED / "text"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"this is not a safetensors file" * 100)
    return directory


def symlink_out() -> Path:
    """A model file linked from inside the root to a real model outside every root."""
    outside, directory = ROOT / "outside", ALLOWED / "link"
    for made in (outside, directory):
        made.mkdir(parents=True, exist_ok=True)
    if not (outside / "model.safetensors").exists():
        shutil.copy(EMBEDDED_MODEL / "model.safetensors", outside / "model.safetensors")
    if not (directory / "model.safetensors").is_symlink():
        (directory / "model.safetensors").symlink_to(outside / "model.safetensors")
    return directory


# fmt: off
ATTACKS: dict[str, Attack] = {
    # 1. one request takes the server down
    "n 10**9 on /generate": Attack(1, generate(sampling(n=FAR)), 400, ("max_n",)),
    "n 10**9 on /v1/completions": Attack(1, generate({"prompt": "1+1=", "n": FAR}, "/v1/completions"), 400,
                                         ("max_n",)),
    "n 10**6 on /v1/chat/completions": Attack(1, generate({"messages": CHAT, "n": 10**6}, "/v1/chat/completions"),
                                              400, ("max_n",)),
    "a 3 MB text": Attack(1, generate({"text": "1+2 " * 750_000}), 400, ("characters cannot be served",)),
    "a text just under the bound": Attack(1, generate({"text": "ab" * 30_000}), 400, ("context holds",)),
    "20,000 prompts in one batch": Attack(1, generate({"text": ["1+1="] * 20_000}), 400, ("max_prompts",)),
    "20,000 token-id prompts": Attack(1, generate({"input_ids": [[5, 6]] * 20_000}), 400, ("max_prompts",)),
    "1,000 prompts x n 10": Attack(1, generate({"text": ["1+1="] * 1000, "sampling_params": {"n": 10}}), 400,
                                   ("max_samples",)),
    "max_new_tokens 10**12": Attack(1, generate(sampling(max_new_tokens=10**12)), 400, ("max_new_tokens",)),
    "a 100,000-token prompt": Attack(1, generate({"input_ids": [5] * 100_000}), 400, ("context holds",)),
    "5,000,000 token ids in 15 MB": Attack(1, generate({"input_ids": [[5] * 5000] * 1000}), 413, ("max_json_items",)),
    "100,000 stop strings": Attack(1, generate(sampling(stop=["x"] * 100_000)), 400, ("max_stop",)),
    "a 1 MB stop string": Attack(1, generate(sampling(stop=["x" * 2**20])), 400, ("max_stop_chars",)),
    "100,000 stop token ids": Attack(1, generate(sampling(stop_token_ids=[5] * 100_000)), 400, ("max_stop",)),
    "a stop token id outside the vocabulary": Attack(1, generate(sampling(stop_token_ids=[10**12])), 400,
                                                     ("stop_token_ids",)),
    "top_logprobs_num 10**9": Attack(1, generate({**sampling(), "return_logprob": True, "top_logprobs_num": FAR}),
                                     400, ("top_logprobs_num",)),
    "5,000 prompts on /v1/completions": Attack(1, generate({"prompt": ["1+1="] * 5000}, "/v1/completions"), 400,
                                               ("max_prompts",)),
    "a 2 MB tools list": Attack(1, generate({"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": f"t{i}", "description": "d" * 2000, "parameters": {}}} for i in range(1000)]},
        "/v1/chat/completions"), 400, ("messages and tools",)),
    "100,000 chat messages": Attack(1, generate({"messages": CHAT * 100_000}, "/v1/chat/completions"), 400,
                                    ("max_prompts",)),
    "200 requests at once": Attack(1, flood(200), 200),
    # 2. one request fails the others
    "temperature 1e-40": Attack(2, generate(sampling(temperature=1e-40)), 200),
    "top_k 2**64-1": Attack(2, generate(sampling(top_k=18446744073709551615, temperature=1.0)), 200),
    "seed -2**63": Attack(2, generate(sampling(sampling_seed=-(2**63), temperature=1.0)), 200),
    "temperature 1e308": Attack(2, generate(sampling(temperature=1e308)), 200),
    # 3. memory pinned after the fact
    "Content-Length of 100 MB": Attack(3, raw("POST", "/generate", b"{}" * 8,
                                              {"Content-Length": str(100 * 2**20), "Content-Type": "application/json"}),
                                       413, ("max_body_mb",)),
    "a 15 MB body under the limit": Attack(3, generate({**NORMAL, "padding": "x" * 15 * 2**20}), 200),
    "a 40 MB body without a length": Attack(3, chunked_body(40 * 2**20), 413, ("body",)),
    "eight 2,000-token prompts at once": Attack(3, burst(8, 2000), 200),
    "60 streams dropped mid-answer": Attack(3, dropped_streams(60), 200),
    # 4. malformed input
    "text []": Attack(4, generate({"text": []}), 400, ("text",)),
    "a content part whose text is a number": Attack(4, generate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "/v1/chat/completions"), 400,
        ("content",)),
    "tool-call arguments nested 1,000 deep": Attack(4, generate(call_with_arguments(
        '{"a":' * 1000 + "1" + "}" * 1000), "/v1/chat/completions"), 400, ("arguments",)),
    "tool-call arguments object nested 500 deep": Attack(4, generate(call_with_arguments(nested(500)),
                                                                     "/v1/chat/completions"), 400, ("arguments",)),
    "model_path a file that is not a model": Attack(4, weights_from(not_a_model), 400, ("not a safetensors",)),
    "presence_penalty on /v1/completions": Attack(4, generate({"prompt": "1", "presence_penalty": 0.5},
                                                              "/v1/completions"), 400, ("presence_penalty",)),
    "logit_bias on chat": Attack(4, generate({"messages": CHAT, "logit_bias": {"5": 3}}, "/v1/chat/completions"),
                                 400, ("logit_bias",)),
    "min_p on chat": Attack(4, generate({"messages": CHAT, "min_p": 0.1}, "/v1/chat/completions"), 400, ("min_p",)),
    "top_k 0 on chat": Attack(4, generate({"messages": CHAT, "top_k": 0}, "/v1/chat/completions"), 400, ("top_k",)),
    "top_k -5 on completions": Attack(4, generate({"prompt": "1", "top_k": -5}, "/v1/completions"), 400, ("top_k",)),
    "min_tokens on chat": Attack(4, generate({"messages": CHAT, "min_tokens": 4}, "/v1/chat/completions"), 400,
                                 ("min_tokens",)),
    "a body that is a JSON list": Attack(4, raw("POST", "/generate", b"[1, 2]", {"Content-Type": "application/json"}),
                                         400, ("JSON object",)),
    "token ids that are strings": Attack(4, generate({"input_ids": ["a", "b"]}), 400, ("input_ids",)),
    # 5. paths
    "model.safetensors a FIFO": Attack(5, weights_from(fifo_model), 400, ("not a regular file",)),
    "a ../ escape": Attack(5, weights_from(lambda: ALLOWED / ".." / ".." / ".." / "etc"), 400, ("outside",)),
    "a symlink out of the root": Attack(5, weights_from(symlink_out), 400, ("outside",)),
    "/dev/zero": Attack(5, weights_from(lambda: Path("/dev/zero")), 400, ("outside",)),
    # 6. reachable from a web page
    "Host: evil.example": Attack(6, raw("POST", "/generate", orjson.dumps(NORMAL),
                                        {"Host": "evil.example", "Content-Type": "application/json"}), 403,
                                 ("loopback",)),
    "a cross-origin POST": Attack(6, raw("POST", "/pause_generation", b"{}", {"Origin": "http://evil.example",
                                                                               "Content-Type": "application/json"}),
                                  403, ("cross-origin",)),
    "a cross-site GET /flush_cache": Attack(6, raw("GET", "/flush_cache", b"", {"Sec-Fetch-Site": "cross-site"}), 403,
                                            ("other sites",)),
    "a text/plain POST /generate": Attack(6, raw("POST", "/generate", orjson.dumps(NORMAL),
                                                 {"Content-Type": "text/plain"}), 400, ("application/json",)),
    "a form POST /pause_generation": Attack(6, raw("POST", "/pause_generation", b"mode=abort",
                                                   {"Content-Type": "application/x-www-form-urlencoded"}), 400,
                                            ("application/json",)),
    "PUT /flush_cache": Attack(6, raw("PUT", "/flush_cache"), 405),
    "DELETE /flush_cache": Attack(6, raw("DELETE", "/flush_cache"), 405),
    "OPTIONS /flush_cache": Attack(6, raw("OPTIONS", "/flush_cache"), 405),
    "TRACE /generate": Attack(6, raw("TRACE", "/generate", b""), 405),
}
# fmt: on


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ALLOWED.mkdir(parents=True, exist_ok=True)
    logs = tmp_path_factory.mktemp("hostile-serve")
    flags = ("--weights-dir", str(ALLOWED), "--set", "engine.prefix_cache_mb=8")
    with serve_processes(EMBEDDED_MODEL, logs, 1, *flags) as (process,):
        probe = HealthProbe(process.url, logs)
        try:
            yield process, probe
        finally:
            probe.close()
            shutil.rmtree(ROOT, ignore_errors=True)


async def normal_request(session: aiohttp.ClientSession, url: str) -> list[int]:
    status, text = await post(session, url + "/generate", NORMAL)
    assert status == 200, text
    return orjson.loads(text)["output_ids"]


@pytest.fixture(scope="module")
def reference(server) -> list[int]:
    """The normal request's tokens before any attack, after a warm-up of the largest work attacked
    (so that RSS before each attack includes what a first burst legitimately keeps)."""

    process, _ = server

    async def warm() -> list[int]:
        async with aiohttp.ClientSession() as session:
            await burst(8, 2000)(session, process.url)
            await dropped_streams(8)(session, process.url)
            return await normal_request(session, process.url)

    ids = asyncio.run(warm())
    asyncio.run(asyncio.sleep(2))  # the engine gives back the burst's memory after 1 s idle
    return ids


@pytest.mark.parametrize("name", ATTACKS)
async def test_the_server_refuses_the_attack_and_serves_on(server, reference, name):
    attack, (process, probe) = ATTACKS[name], server
    outcome = await attack_until_fast(process.url, process.process.pid, probe, attack,
                                      lambda session: normal_request(session, process.url))
    check(outcome, attack, reference)


def test_the_attacks_cover_the_serve_classes():
    assert len(ATTACKS) + len(KEYED_ATTACKS) >= 40
    assert {attack.kind for attack in [*ATTACKS.values(), *KEYED_ATTACKS.values()]} == {1, 2, 3, 4, 5, 6, 8}


async def test_a_flood_past_max_pending_is_answered_busy_at_once_and_the_rest_served():
    """``limits.max_pending`` generations in the server: a request that would pass it is answered 503
    with ``Retry-After`` at once instead of queued; those admitted complete."""
    from aiohttp.test_utils import TestClient, TestServer

    from rollout.config import ServeConfig
    from rollout.engines.local import LocalEngine
    from rollout.limits import ServeLimits
    from rollout.serve.app import EngineServer
    from rollout.tokens import load_tokenizer

    config = ServeConfig(model=str(EMBEDDED_MODEL), limits=ServeLimits(max_pending=4))
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL, config.engine) as engine:
        server = EngineServer(engine, load_tokenizer(EMBEDDED_MODEL), config)
        async with TestClient(TestServer(server.app())) as client:

            async def one(body: dict) -> tuple[int, str, str | None]:
                async with client.post("/generate", json=body) as response:
                    return response.status, await response.text(), response.headers.get("Retry-After")

            await client.post("/pause_generation", json={})  # held, and counted, until generation continues
            first = asyncio.create_task(one({"input_ids": [[5, 6, 7]] * 3, "sampling_params": {"max_new_tokens": 4}}))
            await asyncio.sleep(0.2)
            refused = await one({"input_ids": [[5, 6]] * 2, "sampling_params": {"max_new_tokens": 2}})
            await client.post("/continue_generation", json={})
            admitted = await one({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
            done = await first
    assert refused[0] == 503 and refused[2] == "1" and "limits.max_pending" in refused[1], refused
    assert admitted[0] == 200 and done[0] == 200


# ----- a server with a key: keys (class 6) and the clients' side (class 8) ---------------------------------

KEY = "k3y-" + "x" * 28


def rollout(*flags: str) -> object:
    """``rallyrl rollout`` against the server: its exit status stands for the status, its stderr for the answer."""

    async def send(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        out = ROOT / f"rollout-{len(flags)}.jsonl"
        rallyrl = shutil.which("rallyrl") or "rallyrl"
        process = await asyncio.create_subprocess_exec(
            rallyrl, "rollout", "--engine-url", url, "--task", "calc", "--num-prompts", "2", "-n", "1",
            "--max-new-tokens", "8", "--no-progress", "--out", str(out), *flags,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 120)
        return process.returncode, stderr.decode()

    return send


KEYED_ATTACKS: dict[str, Attack] = {
    "no key": Attack(6, raw("POST", "/generate", orjson.dumps(NORMAL), {"Content-Type": "application/json"}), 401,
                     ("API key",)),
    "a wrong key of the same length": Attack(6, raw("POST", "/generate", orjson.dumps(NORMAL), {
        "Content-Type": "application/json", "Authorization": "Bearer " + "y" * len(KEY)}), 401, ("API key",)),
    "the key and more": Attack(6, raw("POST", "/flush_cache", b"{}", {
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}x"}), 401, ("API key",)),
    "a rollout without the key exits 2 naming the refusal": Attack(8, rollout(), 2,
                                                                   ("HTTP 401", "engine.http.api_key")),
    "a rollout with the key runs": Attack(8, rollout("--set", f"engine.http.api_key={KEY}"), 0),
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    ROOT.mkdir(parents=True, exist_ok=True)
    logs = tmp_path_factory.mktemp("hostile-serve-keyed")
    with serve_processes(EMBEDDED_MODEL, logs, 1, "--api-key", KEY) as (process,):
        probe = HealthProbe(process.url, logs)  # /health needs no key
        try:
            yield process, probe
        finally:
            probe.close()


@pytest.mark.parametrize("name", KEYED_ATTACKS)
async def test_a_keyed_server_refuses_what_lacks_its_key_and_serves_on(keyed, name):
    (process, probe), attack = keyed, KEYED_ATTACKS[name]
    headers = {"Authorization": f"Bearer {KEY}"}

    async def normal(session: aiohttp.ClientSession) -> list[int]:
        status, text = await post(session, process.url + "/generate", NORMAL, headers=headers)
        assert status == 200, text
        return orjson.loads(text)["output_ids"]

    async with aiohttp.ClientSession() as session:
        reference = await normal(session)
    outcome = await attack_until_fast(process.url, process.process.pid, probe, attack, normal)
    check(outcome, attack, reference)


def test_an_empty_key_is_refused_at_start():
    made = subprocess.run([shutil.which("rallyrl") or "rallyrl", "serve", "--api-key", "", "--port", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 2 and "api_key is empty" in made.stderr, made.stderr
