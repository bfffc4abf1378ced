"""``rallyrl serve``'s ``sampling_params`` against SGLang's documented defaults and behaviour (SGLang's
``sampling/sampling_params.py``, ``managers/schedule_batch.py`` ``Req.check_finished``,
``managers/detokenizer_manager.py`` ``trim_matched_stop``; see tests/fixtures/sglang/SOURCES.md):
each default is either matched, checked here on the embedded model, or refused with a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import Generation, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.engines.sglang_protocol import OutputOptions, sampling_from_payload, sampling_params_payload
from rollout.serve.app import EngineServer, ServeConfig
from rollout.serve.generation import eos_token_ids
from rollout.tokens import load_tokenizer

IM_END = 2  # <|im_end|>: the tiny model's eos_token_id (config.json, generation_config.json, tokenizer)
PROMPT = "1+2="  # greedy, the tiny model writes 12 tokens, then <|im_end|>, then goes on


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.fixture
async def local(tokenizer) -> AsyncIterator[tuple[TestClient, LocalEngine]]:
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(device="cpu")) as engine:
        server = EngineServer(engine, tokenizer, ServeConfig(model=str(EMBEDDED_MODEL)))
        async with TestClient(TestServer(server.app())) as client:
            yield client, engine


@pytest.fixture
def client(local) -> TestClient:
    return local[0]


async def generate(client: TestClient, prompt_ids: list[int], **params: Any) -> dict[str, Any]:
    """POST /generate (greedy unless told) and return the 200 answer."""
    body = {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, **params}, "return_logprob": True}
    async with client.post("/generate", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return answer


async def refused(client: TestClient, params: dict[str, Any]) -> str:
    """POST /generate expecting a 400; its message (``{"error": message}`` for a parameter SGLang does
    not know or of the wrong type, as its schema check answers; ``{"error": {"message": ...}}`` else)."""
    async with client.post("/generate", json={"input_ids": [5, 6], "sampling_params": params}) as response:
        assert response.status == 400
        error = (await response.json())["error"]
        return error if isinstance(error, str) else error["message"]


@pytest.fixture
async def free(client, prompt_ids) -> list[int]:
    """The greedy continuation with every stop turned off: it runs through <|im_end|>."""
    ids = (await generate(client, prompt_ids, max_new_tokens=30, ignore_eos=True))["output_ids"]
    assert IM_END in ids[:-1], "the tiny model should write <|im_end|> early after this prompt"
    return ids


def until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(IM_END) + 1]


# ----- EOS and ignore_eos ------------------------------------------------------------------------------


async def test_generate_without_stop_token_ids_stops_at_the_models_eos_like_sglang(client, prompt_ids, free):
    body = await generate(client, prompt_ids, max_new_tokens=30)
    assert body["output_ids"] == until_eos(free)
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": IM_END}


async def test_generate_with_empty_stop_token_ids_still_stops_at_the_eos_like_sglang(client, prompt_ids, free):
    body = await generate(client, prompt_ids, max_new_tokens=30, stop_token_ids=[])
    assert body["output_ids"] == until_eos(free)


async def test_the_eos_token_stays_in_output_ids_with_its_logprob(client, prompt_ids, free):
    body = await generate(client, prompt_ids, max_new_tokens=30)
    triples = body["meta_info"]["output_token_logprobs"]
    assert body["output_ids"][-1] == IM_END
    assert [token for _, token, _ in triples] == body["output_ids"]
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"])


async def test_ignore_eos_runs_to_max_new_tokens(client, prompt_ids, free):
    body = await generate(client, prompt_ids, max_new_tokens=30, ignore_eos=True)
    assert body["output_ids"] == free
    assert len(body["output_ids"]) == 30
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 30}


async def test_ignore_eos_also_turns_off_stop_token_ids_like_sglang(client, prompt_ids, free):
    body = await generate(client, prompt_ids, max_new_tokens=30, ignore_eos=True, stop_token_ids=[free[2]])
    assert body["output_ids"] == free


async def test_stop_token_ids_stop_besides_the_eos(client, prompt_ids, free):
    early = free[3]
    body = await generate(client, prompt_ids, max_new_tokens=30, stop_token_ids=[early])
    assert body["output_ids"] == free[: free.index(early) + 1]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": early}


async def test_max_new_tokens_is_checked_before_the_eos_like_sglang(client, prompt_ids, free):
    budget = len(until_eos(free))  # the EOS is the last token the budget allows
    body = await generate(client, prompt_ids, max_new_tokens=budget, skip_special_tokens=False)
    assert body["output_ids"] == until_eos(free)
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": budget}
    assert body["text"].endswith("<|im_end|>")  # a "length" finish trims nothing


def test_the_eos_ids_are_gathered_from_config_generation_config_and_tokenizer_like_sglang(tmp_path, tokenizer):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    assert eos_token_ids(str(tmp_path), tokenizer) == [IM_END, 5, 6, 7]
    assert eos_token_ids(str(EMBEDDED_MODEL), tokenizer) == [IM_END]


# ----- skip_special_tokens and no_stop_trim --------------------------------------------------------------


async def test_skip_special_tokens_defaults_to_true_leaving_them_out_of_the_text(client, prompt_ids, free, tokenizer):
    body = await generate(client, prompt_ids, max_new_tokens=30, ignore_eos=True)
    assert "<|im_end|>" not in body["text"]
    assert body["text"] == tokenizer.decode(free, skip_special_tokens=True)


async def test_skip_special_tokens_false_keeps_them_in_the_text(client, prompt_ids, free, tokenizer):
    body = await generate(client, prompt_ids, max_new_tokens=30, ignore_eos=True, skip_special_tokens=False)
    assert body["text"] == tokenizer.decode(free, skip_special_tokens=False)
    assert "<|im_end|>" in body["text"]


async def test_the_stop_token_is_trimmed_from_the_text_unless_no_stop_trim(client, prompt_ids, free, tokenizer):
    trimmed = await generate(client, prompt_ids, max_new_tokens=30, skip_special_tokens=False)
    kept = await generate(client, prompt_ids, max_new_tokens=30, skip_special_tokens=False, no_stop_trim=True)
    assert trimmed["text"] == tokenizer.decode(until_eos(free)[:-1], skip_special_tokens=False)
    assert kept["text"] == tokenizer.decode(until_eos(free), skip_special_tokens=False)
    assert kept["text"].endswith("<|im_end|>")
    assert trimmed["output_ids"] == kept["output_ids"] == until_eos(free)


async def test_a_stop_token_that_is_not_special_is_trimmed_from_the_text_too(client, prompt_ids, free, tokenizer):
    stop = free[3]
    body = await generate(client, prompt_ids, max_new_tokens=30, stop_token_ids=[stop])
    assert body["text"] == tokenizer.decode(free[: free.index(stop)])


async def test_spaces_between_special_tokens_is_passed_to_the_tokenizer(client, prompt_ids, free, tokenizer):
    params = {"max_new_tokens": 30, "ignore_eos": True, "skip_special_tokens": False}
    body = await generate(client, prompt_ids, spaces_between_special_tokens=False, **params)
    assert body["text"] == tokenizer.decode(free, skip_special_tokens=False, spaces_between_special_tokens=False)


async def test_rallyrls_own_payload_keeps_todays_tokens_text_and_logprobs(local, prompt_ids, tokenizer):
    client, engine = local
    sampling = SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[IM_END])
    direct = await engine.generate(prompt_ids, sampling, "direct")
    body = {"input_ids": prompt_ids, "sampling_params": sampling_params_payload(sampling), "return_logprob": True}
    async with client.post("/generate", json=body) as response:
        served = await response.json()
    assert served["output_ids"] == direct.output_ids
    assert served["output_ids"][-1] == IM_END
    assert served["text"] == tokenizer.decode(direct.output_ids, skip_special_tokens=False)  # stop token kept
    logprobs = [lp for lp, _, _ in served["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(direct.output_logprobs, abs=1e-5)


# ----- stop strings ----------------------------------------------------------------------------------------


async def test_stop_strings_end_the_text_and_are_trimmed_unless_no_stop_trim(client, prompt_ids, free, tokenizer):
    text = tokenizer.decode(free)
    stop = text[4:6]
    end = next(k for k in range(1, len(free) + 1) if stop in tokenizer.decode(free[:k]))
    trimmed = await generate(client, prompt_ids, max_new_tokens=30, stop=stop)
    kept = await generate(client, prompt_ids, max_new_tokens=30, stop=[stop], no_stop_trim=True)
    assert trimmed["output_ids"] == kept["output_ids"] == free[:end]  # the stop string's tokens are kept
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[: text.index(stop)]
    assert kept["text"] == tokenizer.decode(free[:end])
    assert len(trimmed["meta_info"]["output_token_logprobs"]) == end


async def test_the_first_of_several_stop_strings_ends_the_generation(client, prompt_ids, free, tokenizer):
    text = tokenizer.decode(free)
    first = text[4:6]
    later = next(text[i : i + 2] for i in range(len(text)) if text.find(text[i : i + 2]) > text.find(first))
    body = await generate(client, prompt_ids, max_new_tokens=30, stop=[later, first])
    assert body["meta_info"]["finish_reason"]["matched"] == first


async def test_a_stop_string_ends_a_streamed_generation_too(client, prompt_ids, free, tokenizer):
    text = tokenizer.decode(free)
    stop = text[4:6]
    body = {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 30, "stop": stop},
            "stream": True}  # fmt: skip
    async with client.post("/generate", json=body) as response:
        events = [e[len("data: ") :] for e in (await response.text()).split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert last["text"] == text[: text.index(stop)]


async def test_a_stop_string_aborts_the_rest_of_the_generation(local, prompt_ids, tokenizer):
    client, engine = local
    first = (await generate(client, prompt_ids, max_new_tokens=3, ignore_eos=True))["output_ids"]
    before = engine.stats.generated_tokens
    body = await generate(client, prompt_ids, max_new_tokens=3000, ignore_eos=True, stop=tokenizer.decode(first))
    assert body["output_ids"] == first
    assert engine.stats.generated_tokens - before < 100  # not 3000


async def test_a_stop_string_in_the_eos_token_is_the_eos_match(client, prompt_ids, free, tokenizer):
    # SGLang checks stop tokens before stop strings: "<|im_end|>" as a string never wins over the EOS
    body = await generate(client, prompt_ids, max_new_tokens=30, stop="<|im_end|>")
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": IM_END}


# ----- the other defaults ------------------------------------------------------------------------------------


def test_the_defaults_are_sglangs():
    sampling, options = sampling_from_payload({}, eos_token_ids=[IM_END])
    assert sampling == SamplingParams(max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=[IM_END])
    assert options == OutputOptions(stop=(), skip_special_tokens=True, spaces_between_special_tokens=True,
                                    no_stop_trim=False)  # fmt: skip


def test_null_means_the_default_like_sglang():
    names = ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
             "no_stop_trim", "min_new_tokens", "n", "min_p")  # fmt: skip
    nulls = dict.fromkeys(names)
    assert sampling_from_payload(nulls, [IM_END], 4096) == sampling_from_payload({"max_new_tokens": 4096}, [IM_END])


def test_max_new_tokens_null_runs_to_the_context_length_like_sglang():
    sampling, _ = sampling_from_payload({"max_new_tokens": None}, [IM_END], context_length=4096)
    assert sampling.max_new_tokens == 4096


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("min_new_tokens", 4),
        ("min_p", 0.1),
        ("frequency_penalty", 0.5),
        ("presence_penalty", 0.5),
        ("repetition_penalty", 1.1),
        ("logit_bias", {"5": 2.0}),
        ("json_schema", "{}"),
        ("regex", "[0-9]+"),
        ("ebnf", 'root ::= "a"'),
        ("structural_tag", "{}"),
        ("stop_regex", "[0-9]"),
        ("custom_params", {"a": 1}),
        ("stream_interval", 4),
    ],
)
async def test_a_sampling_param_rallyrl_serve_does_not_implement_is_a_400_naming_it(client, name, value):
    message = await refused(client, {name: value})
    assert f"sampling_params.{name}: only" in message
    assert "rallyrl serve" in message


async def test_n_above_one_answers_a_list_of_n_samples_like_sglang(client, prompt_ids):
    body = {"input_ids": prompt_ids, "sampling_params": {"n": 3, "max_new_tokens": 4, "ignore_eos": True}}
    async with client.post("/generate", json=body) as response:
        answers = await response.json()
    assert [len(answer["output_ids"]) for answer in answers] == [4, 4, 4]
    assert len({answer["meta_info"]["id"] for answer in answers}) == 3


async def test_min_new_tokens_above_zero_is_a_400(client):
    assert "sampling_params.min_new_tokens: only 0" in await refused(client, {"min_new_tokens": 1})


async def test_sglangs_default_values_of_the_params_it_does_not_implement_are_accepted(client, prompt_ids):
    defaults = {"min_new_tokens": 0, "n": 1, "min_p": 0.0, "frequency_penalty": 0, "presence_penalty": 0.0,
                "repetition_penalty": 1.0, "logit_bias": None, "json_schema": None, "stream_interval": 1}  # fmt: skip
    body = await generate(client, prompt_ids, max_new_tokens=2, **defaults)
    assert 1 <= len(body["output_ids"]) <= 2


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": 5}, "sampling_params.max_tokens"),
        ({"top_k": 0}, "sampling_params.top_k"),
        ({"stop": 5}, "sampling_params.stop"),
        ({"stop": [""]}, "sampling_params.stop"),
        ({"ignore_eos": "yes"}, "sampling_params.ignore_eos"),
        ({"skip_special_tokens": 0}, "sampling_params.skip_special_tokens"),
        ({"no_stop_trim": "true"}, "sampling_params.no_stop_trim"),
    ],
    ids=lambda value: None if isinstance(value, dict) else value,
)
async def test_a_malformed_or_unknown_sampling_param_is_a_400_naming_it(client, params, field):
    assert field in await refused(client, params)


# ----- the OpenAI endpoints share the EOS default --------------------------------------------------------------


async def test_v1_completions_stop_at_the_models_eos_unless_ignore_eos(client, free):
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    async with client.post("/v1/completions", json=body) as response:
        stopped = await response.json()
    async with client.post("/v1/completions", json={**body, "ignore_eos": True}) as response:
        running = await response.json()
    assert stopped["usage"]["completion_tokens"] == len(until_eos(free))
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert running["usage"]["completion_tokens"] == 30
    assert running["choices"][0]["finish_reason"] == "length"


def test_a_generation_cut_at_a_stop_string_reports_the_string():
    from rollout.engines.sglang_protocol import finish_reason_payload

    cut = Generation([5, 6], [-0.1, -0.2], "stop", meta={"matched_stop": "ab"})
    assert finish_reason_payload(cut) == {"type": "stop", "matched": "ab"}
    assert finish_reason_payload(Generation([5, IM_END], [-0.1, -0.2], "stop")) == {"type": "stop", "matched": IM_END}
