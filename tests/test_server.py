"""``rallyrl serve`` (EngineServer) in-process on loopback: the embedded model behind SGLang's native
API and the OpenAI endpoints, compared with recorded SGLang responses where shapes matter."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from conftest import ScriptedEngine
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.serve.app import EngineServer, ServeConfig, serve
from rollout.tokens import ChatTokenizer, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
CPU = LocalEngineConfig(device="cpu")
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
LONG = 3000  # tokens: seconds of generation on CPU, aborted long before the end


@pytest.fixture(scope="module")
def model_tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def prompt(model_tokenizer) -> list[int]:
    text = model_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    return model_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def perturbed_model_dir(tmp_path_factory) -> Path:
    """The embedded model with noise on every weight, saved with save_pretrained."""
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, local_files_only=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    directory = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(directory)
    return directory


@contextlib.asynccontextmanager
async def served(engine: Any, tokenizer: Any, **config: Any) -> AsyncIterator[TestClient]:
    config.setdefault("weights_dirs", [tempfile.gettempdir()])  # where the tests' weights are written
    server = EngineServer(engine, tokenizer, ServeConfig(model=str(EMBEDDED_MODEL), **config))
    async with TestClient(TestServer(server.app())) as client:
        yield client


@pytest.fixture
async def local(model_tokenizer) -> AsyncIterator[tuple[TestClient, LocalEngine]]:
    """The embedded model in a LocalEngine, served on loopback."""
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL, CPU) as engine, served(engine, model_tokenizer) as client:
        yield client, engine


@pytest.fixture
def client(local) -> TestClient:
    return local[0]


def scripted(tokenizer: Any, script: Callable[[int, str, str], str]) -> ScriptedEngine:
    return ScriptedEngine(ChatTokenizer(tokenizer), script)


async def post(client: TestClient, path: str, body: Any = None) -> tuple[int, Any]:
    """POST JSON; returns the status and the decoded JSON (or text) body."""
    async with client.post(path, json=body) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text


async def get(client: TestClient, path: str) -> tuple[int, Any]:
    async with client.get(path) as response:
        text = await response.text()
        return response.status, json.loads(text) if text else text


def generate_body(
    input_ids: Any,
    max_new_tokens: int = 8,
    temperature: float = 0.0,
    sampling: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A /generate body; ``sampling`` adds to (or overrides) the sampling_params."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": [], **(sampling or {})}
    return {"input_ids": input_ids, "sampling_params": params, **extra}


def recorded(name: str) -> Any:
    """The body of a response recorded from a real SGLang (``tests/fixtures/record_sglang.py``)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


def error_message(answer: dict[str, Any]) -> str:
    """The message of an error in any of SGLang's shapes: ``{"error": {"message"}}``, ``{"error": str}``
    (its /generate schema check) or OpenAI's ``{"object": "error", "message"}``."""
    error = answer.get("error", answer)
    return error if isinstance(error, str) else error["message"]


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.002)


def shape(value: Any) -> Any:
    """The structure of a JSON value: keys of objects, the element shape of lists (element by element
    for tuple-like lists such as logprob triples), and the type name of every leaf."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes = [shape(item) for item in value]
        return shapes if len({repr(s) for s in shapes}) > 1 else shapes[:1]
    return type(value).__name__


# ----- /generate ------------------------------------------------------------------------------------


async def test_generate_by_input_ids_returns_text_output_ids_and_meta_info(client, model_tokenizer, prompt):
    status, body = await post(client, "/generate", generate_body(prompt, 8, rid="req-1"))
    assert status == 200
    assert len(body["output_ids"]) == 8
    assert body["text"] == model_tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    meta = body["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == 8
    assert meta["weight_version"] == "default"
    assert "output_token_logprobs" not in meta


async def test_generate_by_text_encodes_the_prompt(client, model_tokenizer):
    text = "1+2="
    status, body = await post(client, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 3}})
    assert status == 200
    assert body["meta_info"]["prompt_tokens"] == len(model_tokenizer.encode(text, add_special_tokens=False))
    assert 1 <= len(body["output_ids"]) <= 3


async def test_generate_with_a_list_of_input_ids_answers_a_list_in_order(client, prompt):
    body = generate_body([prompt, prompt[:-3]], 4, sampling={"ignore_eos": True}, rid=["a", "b"])
    status, body = await post(client, "/generate", body)
    assert status == 200
    assert [item["meta_info"]["id"] for item in body] == ["a", "b"]
    assert [item["meta_info"]["prompt_tokens"] for item in body] == [len(prompt), len(prompt) - 3]
    assert [len(item["output_ids"]) for item in body] == [4, 4]


async def test_generate_with_a_list_of_sampling_params_applies_one_per_prompt(client, prompt):
    params = [{"max_new_tokens": n, "temperature": 0, "stop_token_ids": []} for n in (2, 5)]
    status, body = await post(client, "/generate", {"input_ids": [prompt, prompt], "sampling_params": params})
    assert status == 200
    assert [len(item["output_ids"]) for item in body] == [2, 5]
    assert body[1]["output_ids"][:2] == body[0]["output_ids"]


async def test_generate_stream_sends_cumulative_output_ids_and_ends_with_done(client, prompt):
    async with client.post("/generate", json=generate_body(prompt, 6, stream=True)) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) >= 2
    ids = [chunk["output_ids"] for chunk in chunks]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))
    assert len(ids[-1]) == 6
    assert [chunk["meta_info"]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_return_logprob_gives_triples_aligned_with_output_ids(client, prompt):
    status, body = await post(client, "/generate", generate_body(prompt, 6, temperature=1.0, return_logprob=True))
    assert status == 200
    triples = body["meta_info"]["output_token_logprobs"]
    assert [token for _, token, _ in triples] == body["output_ids"]
    assert all(isinstance(logprob, float) and logprob <= 0 for logprob, _, _ in triples)
    assert body["meta_info"]["input_token_logprobs"] == []  # SGLang 0.5.23: none without logprob_start_len


async def test_greedy_generation_gives_the_same_result_twice(client, prompt):
    _, first = await post(client, "/generate", generate_body(prompt, 16, return_logprob=True))
    _, second = await post(client, "/generate", generate_body(prompt, 16, return_logprob=True))
    assert second["output_ids"] == first["output_ids"]
    logprobs = [[triple[0] for triple in body["meta_info"]["output_token_logprobs"]] for body in (first, second)]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-4)


async def test_stop_token_ids_end_the_generation_at_the_first_stop_token(client, prompt):
    _, free = await post(client, "/generate", generate_body(prompt, 12))
    stop = free["output_ids"][4]
    expected = free["output_ids"][: free["output_ids"].index(stop) + 1]
    body = generate_body(prompt, 12)
    body["sampling_params"]["stop_token_ids"] = [stop]
    status, stopped = await post(client, "/generate", body)
    assert status == 200
    assert stopped["output_ids"] == expected
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_generate_with_one_rid_for_a_batch_numbers_it_per_prompt_like_sglang(client, prompt):
    status, answers = await post(client, "/generate", generate_body([prompt, prompt], 2, rid="batch"))
    assert status == 200
    assert [answer["meta_info"]["id"] for answer in answers] == ["batch_0", "batch_1"]


async def test_max_new_tokens_zero_answers_no_tokens_with_finish_length_like_sglang(client, prompt):
    status, answer = await post(client, "/generate", generate_body(prompt, 0))
    assert status == 200
    assert answer["output_ids"] == []
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_a_streamed_batch_sends_each_prompts_chunks_with_its_index_like_sglang(client, prompt):
    body = generate_body([prompt, prompt[:-3]], 3, sampling={"ignore_eos": True}, stream=True)
    async with client.post("/generate", json=body) as response:
        events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for index in (0, 1):
        mine = [chunk for chunk in chunks if chunk["index"] == index]
        assert [len(chunk["output_ids"]) for chunk in mine] == [1, 2, 3]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [5, "a"]}, "input_ids"),
        ({"input_ids": "5 6"}, "input_ids"),
        ({"input_ids": [[5, 6], []]}, "input_ids[1]"),
        ({"sampling_params": {}}, "text or input_ids"),
        ({"text": ["a", 5]}, "text"),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": "hot"}}, "sampling_params"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [5, 6], "sampling_params": {"stop_token_ids": "2"}}, "sampling_params.stop_token_ids"),
        ({"input_ids": [5, 6], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
        ({"input_ids": [[5], [6]], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params: 1 values for 2"),
        ({"input_ids": [[5], [6]], "rid": ["one"]}, "rid"),
    ],
    ids=lambda value: None if isinstance(value, dict) else value,
)
async def test_a_bad_generate_request_is_a_400_naming_the_field(client, body, field):
    status, answer = await post(client, "/generate", body)
    assert status == 400
    assert field in error_message(answer)


@pytest.mark.parametrize(
    ("body", "shape"),
    [
        ({"input_ids": [5, 6], "sampling_params": {"not_a_param": 1}}, {"error"}),  # SGLang's schema check
        ({"input_ids": "5 6"}, {"object", "message", "type", "param", "code"}),  # its FastAPI validation
        ({"input_ids": []}, {"error"}),
    ],
    ids=["unknown_sampling_param", "wrong_json_type", "empty_prompt"],
)
async def test_a_bad_generate_request_has_the_error_body_sglang_gives_it(client, body, shape):
    status, answer = await post(client, "/generate", body)
    assert status == 400
    assert set(answer) == shape
    if shape == {"error"}:
        assert isinstance(answer["error"], str) == ("not_a_param" in json.dumps(body))


@pytest.mark.parametrize(("params", "field"), [({"temperature": "hot"}, "temperature"), ({"top_k": "x"}, "top_k")])
async def test_a_sampling_param_of_the_wrong_type_is_named_in_the_400(client, params, field):
    status, answer = await post(client, "/generate", {"input_ids": [5, 6], "sampling_params": params})
    assert status == 400
    assert f"sampling_params.{field}" in error_message(answer)


@pytest.mark.parametrize(("raw", "message"), [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object")])
async def test_a_body_that_is_not_a_json_object_is_a_400(client, raw, message):
    async with client.post("/generate", data=raw, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
        assert message in error_message(await response.json())


@pytest.mark.parametrize("input_ids", [5, {"a": 1}], ids=["number", "object"])
async def test_input_ids_that_are_not_a_list_are_a_400(client, input_ids):
    status, answer = await post(client, "/generate", {"input_ids": input_ids})
    assert status == 400
    assert "input_ids" in error_message(answer)


@pytest.mark.parametrize("token", [10**6, -1])
async def test_an_input_id_outside_the_vocabulary_is_a_400(client, token):
    status, answer = await post(client, "/generate", generate_body([5, token]))
    assert status == 400
    assert "input_ids" in error_message(answer)


async def test_an_input_id_outside_the_vocabulary_does_not_fail_the_requests_batched_with_it(client, prompt):
    good = generate_body(prompt, 20)
    results = await asyncio.gather(
        post(client, "/generate", good),
        post(client, "/generate", generate_body([5, 10**6])),
        post(client, "/generate", good),
    )
    assert [results[0][0], results[2][0]] == [200, 200]


# ----- health, info, cache --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
async def test_health_endpoints_answer_200(client, path):
    async with client.get(path) as response:
        assert response.status == 200


async def test_get_model_info_has_sglangs_keys_and_the_model(client):
    sglangs = recorded("get_model_info")
    status, info = await get(client, "/get_model_info")
    assert status == 200
    assert list(info) == [key for key in sglangs if key != "embedding"]  # rallyrl serves no embeddings
    assert info["model_path"] == str(EMBEDDED_MODEL)
    assert info["weight_version"] == "default"
    assert info["model_type"] == "qwen2"
    assert info["architectures"] == ["Qwen2ForCausalLM"]


async def test_get_server_info_reports_the_server_settings_and_state(client):
    sglangs = recorded("get_server_info")
    status, info = await get(client, "/get_server_info")
    assert status == 200
    for key in ("model_path", "context_length", "weight_version", "tp_size", "dp_size", "disaggregation_mode",
                "status", "internal_states"):  # fmt: skip
        assert key in sglangs and key in info
    assert info["served_model_name"] == "tiny-calc"
    assert info["context_length"] == 4096
    assert info["internal_states"][0]["in_flight"] == 0


async def test_flush_cache_answers_sglangs_text(client):
    async with client.post("/flush_cache") as response:
        assert response.status == 200
        assert (await response.text()).startswith("Cache flushed.")


# ----- abort, pause, weight updates ---------------------------------------------------------------------


async def test_abort_request_ends_a_long_generation_with_its_partial_output(local, prompt):
    client, engine = local
    running = asyncio.create_task(post(client, "/generate", generate_body(prompt, LONG, 1.0, rid="long")))
    await wait_until(lambda: engine.stats.generated_tokens > 0)
    async with client.post("/abort_request", json={"rid": "long"}) as response:
        assert response.status == 200
    status, body = await asyncio.wait_for(running, 10)
    assert status == 200
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["id"] == "long"
    assert 0 < len(body["output_ids"]) < LONG


async def test_pause_generation_aborts_requests_in_flight_and_holds_new_ones_until_continue(local, prompt):
    client, engine = local
    running = asyncio.create_task(post(client, "/generate", generate_body(prompt, LONG, 1.0)))
    await wait_until(lambda: engine.stats.generated_tokens > 0)
    assert await post(client, "/pause_generation", {"mode": "abort"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    _, aborted = await asyncio.wait_for(running, 10)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < LONG

    held = asyncio.create_task(post(client, "/generate", generate_body(prompt, 4)))
    await asyncio.sleep(0.3)
    assert not held.done()
    assert (await post(client, "/continue_generation", {}))[0] == 200
    status, body = await asyncio.wait_for(held, 10)
    assert status == 200
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


async def test_update_weights_from_disk_changes_the_output_and_the_weight_version(client, prompt, perturbed_model_dir):
    _, before = await post(client, "/generate", generate_body(prompt, 12, return_logprob=True))
    status, answer = await post(
        client, "/update_weights_from_disk", {"model_path": str(perturbed_model_dir), "weight_version": "7"}
    )
    assert status == 200
    assert answer == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 7.",
        "num_paused_requests": 0,
    }
    _, after = await post(client, "/generate", generate_body(prompt, 12, return_logprob=True))
    logprobs = [[triple[0] for triple in body["meta_info"]["output_token_logprobs"]] for body in (before, after)]
    assert after["output_ids"] != before["output_ids"]
    assert logprobs[1] != pytest.approx(logprobs[0], abs=1e-3)
    assert after["meta_info"]["weight_version"] == "7"
    assert (await get(client, "/get_model_info"))[1]["weight_version"] == "7"


async def test_a_weight_version_name_is_reported_as_given_like_sglang(client, prompt):
    body = {"model_path": str(EMBEDDED_MODEL), "weight_version": "step_7"}
    assert (await post(client, "/update_weights_from_disk", body))[0] == 200
    _, answer = await post(client, "/generate", generate_body(prompt, 2))
    assert answer["meta_info"]["weight_version"] == "step_7"
    assert answer["meta_info"]["weight_versions"] == [{"version": "step_7", "start": 0, "end": 2}]
    assert (await get(client, "/get_model_info"))[1]["weight_version"] == "step_7"


async def test_a_weight_update_from_a_bad_path_fails_with_400_and_the_server_keeps_serving(client, prompt, tmp_path):
    status, answer = await post(
        client, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing"), "weight_version": "7"}
    )
    assert status == 400
    assert answer["success"] is False
    assert str(tmp_path / "missing") in answer["message"]
    status, body = await post(client, "/generate", generate_body(prompt, 3))
    assert status == 200
    assert body["meta_info"]["weight_version"] == "default"
    assert (await get(client, "/get_model_info"))[1]["weight_version"] == "default"


async def test_a_weight_update_waits_for_requests_in_flight_so_each_response_has_one_version(
    local, prompt, perturbed_model_dir
):
    client, engine = local
    body = generate_body(prompt, 500)
    _, old = await post(client, "/generate", body)
    tokens = engine.stats.generated_tokens
    in_flight = asyncio.create_task(post(client, "/generate", body))
    await wait_until(lambda: engine.stats.generated_tokens > tokens)
    update = asyncio.create_task(
        post(client, "/update_weights_from_disk", {"model_path": str(perturbed_model_dir), "weight_version": "7"})
    )
    await asyncio.sleep(0.05)
    after_update = asyncio.create_task(post(client, "/generate", body))
    await asyncio.sleep(0.05)
    assert not in_flight.done(), "the first request must still be generating when the update arrives"
    (_, first), (status, _), (_, second) = await asyncio.wait_for(asyncio.gather(in_flight, update, after_update), 20)
    assert status == 200
    assert first["output_ids"] == old["output_ids"]
    assert first["meta_info"]["weight_version"] == "default"
    assert second["meta_info"]["weight_version"] == "7"
    assert second["output_ids"] != old["output_ids"]


# ----- OpenAI-compatible --------------------------------------------------------------------------------


async def test_v1_models_lists_the_served_model(client):
    status, models = await get(client, "/v1/models")
    assert status == 200
    assert models["object"] == "list"
    [model] = models["data"]
    assert model["id"] == "tiny-calc"
    assert model["object"] == "model"
    assert list(model) == list(recorded("models")["data"][0])


async def test_v1_completions_continues_a_text_prompt(client, model_tokenizer):
    status, completion = await post(client, "/v1/completions", {"prompt": "1+2=", "max_tokens": 4, "temperature": 0})
    assert status == 200
    assert completion["object"] == "text_completion"
    assert completion["model"] == "tiny-calc"
    [choice] = completion["choices"]
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = completion["usage"]
    assert usage["prompt_tokens"] == len(model_tokenizer.encode("1+2=", add_special_tokens=False))
    assert 1 <= usage["completion_tokens"] <= 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_v1_completions_stream_sends_a_chunk_per_token_the_last_with_the_finish_reason(client):
    body = {"prompt": "1+2=", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.post("/v1/completions", json=body) as response:
        events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [choice["finish_reason"] for choice in choices] == [None, None, None, "length"]
    _, whole = await post(client, "/v1/completions", {**body, "stream": False})
    assert "".join(choice["text"] for choice in choices) == whole["choices"][0]["text"]


async def test_v1_requests_must_be_json_like_sglang(client):
    body = json.dumps({"prompt": "1+2=", "max_tokens": 2})
    async with client.post("/v1/completions", data=body, headers={"Content-Type": "text/plain"}) as response:
        assert response.status == 400
        assert "Content-Type" in (await response.json())["message"]


async def test_v1_completions_with_a_seed_that_is_not_a_number_is_a_400(client):
    status, answer = await post(client, "/v1/completions", {"prompt": "1+2=", "max_tokens": 4, "seed": "abc"})
    assert status == 400
    assert "seed" in error_message(answer)


async def test_v1_chat_completions_answers_an_assistant_message(client):
    messages = [{"role": "user", "content": "What is 2+3?"}]
    status, completion = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 8})
    assert status == 200
    assert completion["object"] == "chat.completion"
    [choice] = completion["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert "tool_calls" not in choice["message"]  # as SGLang 0.5.23 leaves it out
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= completion["usage"]["completion_tokens"] <= 8


async def test_v1_chat_completions_returns_a_tool_call_as_tool_calls(model_tokenizer):
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: TOOL_CALL)
    body = {"messages": [{"role": "user", "content": "What is 2+3?"}], "tools": [CALCULATOR]}
    async with served(engine, model_tokenizer) as client:
        status, completion = await post(client, "/v1/chat/completions", body)
    assert status == 200
    [choice] = completion["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == ""  # the text around the calls, as SGLang has it
    [call] = message["tool_calls"]
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}


async def test_v1_chat_completions_renders_the_tools_into_the_prompt(model_tokenizer):
    prompts: list[str] = []
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: prompts.append(prompt) or "ok")
    body = {"messages": [{"role": "user", "content": "What is 2+3?"}], "tools": [CALCULATOR]}
    async with served(engine, model_tokenizer) as client:
        status, _ = await post(client, "/v1/chat/completions", body)
    assert status == 200
    assert '"name": "calculator"' in prompts[0]


async def test_v1_chat_completions_accepts_assistant_tool_calls_and_tool_messages_in_the_history(model_tokenizer):
    prompts: list[str] = []
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: prompts.append(prompt) or "2+3 = 5")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
    }
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    async with served(engine, model_tokenizer) as client:
        status, completion = await post(client, "/v1/chat/completions", {"messages": messages, "tools": [CALCULATOR]})
    assert status == 200
    assert completion["choices"][0]["message"]["content"] == "2+3 = 5"
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert '<tool_call>\n{"name":"calculator","arguments":{"expression":"2+3"}}\n</tool_call>' in prompts[0]
    assert "<tool_response>\n5\n</tool_response>" in prompts[0]


async def test_v1_chat_completions_stream_sends_chunks_and_ends_with_done(model_tokenizer):
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: TOOL_CALL)
    body = {"messages": [{"role": "user", "content": "What is 2+3?"}], "tools": [CALCULATOR], "stream": True}
    async with served(engine, model_tokenizer) as client, client.post("/v1/chat/completions", json=body) as response:
        assert response.status == 200
        events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0]["role"] == "assistant"
    first, *rest = [call for delta in deltas for call in delta.get("tool_calls") or []]  # as SGLang streams them:
    assert first["function"] == {"name": "calculator", "arguments": ""}  # the name, then the arguments
    assert json.loads("".join(call["function"]["arguments"] for call in rest)) == {"expression": "2+3"}
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == "tool_calls"


async def test_v1_chat_completions_reports_the_weight_version_in_metadata_as_sglang_does(client):
    messages = [{"role": "user", "content": "What is 2+3?"}]
    _, completion = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    tokens = completion["usage"]["completion_tokens"]
    spans = [{"version": "default", "start": 0, "end": tokens}]
    assert completion["metadata"] == {"weight_version": "default", "weight_versions": spans}


# ----- API key --------------------------------------------------------------------------------------------


async def test_with_an_api_key_requests_without_it_are_401_and_with_it_are_served(model_tokenizer, prompt):
    async with (
        LocalEngine.from_pretrained(EMBEDDED_MODEL, CPU) as engine,
        served(engine, model_tokenizer, api_key="sekret") as client,
    ):
        status, answer = await post(client, "/generate", generate_body(prompt, 2))
        assert status == 401
        assert "API key" in error_message(answer)
        async with client.get("/v1/models") as response:
            assert response.status == 401
            assert (await response.json())["type"] == "AuthenticationError"
        async with client.post(
            "/generate", json=generate_body(prompt, 2), headers={"Authorization": "Bearer sekret"}
        ) as response:
            assert response.status == 200


async def test_with_an_api_key_health_is_open_as_in_sglang(model_tokenizer):
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: "ok")
    async with served(engine, model_tokenizer, api_key="sekret") as client, client.get("/health") as response:
        assert response.status == 200


# ----- shapes against recorded SGLang responses ----------------------------------------------------------


async def test_generate_response_has_the_shape_of_sglangs(client, prompt):
    sglangs = recorded("generate_logprob")
    _, ours = await post(client, "/generate", generate_body(prompt, 8, return_logprob=True))
    assert list(ours) == list(sglangs)
    assert list(ours["meta_info"]) == list(sglangs["meta_info"])
    for key in ("finish_reason", "output_token_logprobs", "weight_version", "weight_versions", "output_ids"):
        theirs = sglangs["meta_info"].get(key, sglangs.get(key))
        assert shape(ours["meta_info"].get(key, ours.get(key))) == shape(theirs), key


async def test_chat_tool_call_response_has_the_shape_of_sglangs(model_tokenizer):
    sglangs = recorded("chat_completion_tool_calls")
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: "Let me compute.\n" + TOOL_CALL)
    body = {"messages": [{"role": "user", "content": "What is 2+3?"}], "tools": [CALCULATOR]}
    async with served(engine, model_tokenizer) as client:
        _, ours = await post(client, "/v1/chat/completions", body)
    assert list(ours) == list(sglangs)
    choice, their_choice = ours["choices"][0], sglangs["choices"][0]
    assert list(choice) == list(their_choice)
    assert shape(choice["message"]) == shape(their_choice["message"])
    assert shape(choice["message"]["tool_calls"][0]) == shape(their_choice["message"]["tool_calls"][0])
    assert choice["finish_reason"] == their_choice["finish_reason"] == "tool_calls"
    assert list(ours["usage"]) == list(sglangs["usage"])


# ----- serve() ----------------------------------------------------------------------------------------------


async def test_serve_binds_a_free_port_and_answers_until_cancelled(model_tokenizer):
    engine = scripted(model_tokenizer, lambda turn, prompt, rid: "ok")
    config = ServeConfig(model=str(EMBEDDED_MODEL), port=0)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(engine, model_tokenizer, config, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        assert config.port != 0
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{config.port}/health") as response:
                assert response.status == 200
            async with session.get(f"http://127.0.0.1:{config.port}/get_server_info") as response:
                assert (await response.json())["port"] == config.port
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
