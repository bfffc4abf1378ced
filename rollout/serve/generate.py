"""How ``rallyrl serve`` runs ``/generate`` the way SGLang 0.5.23 does: the request read into one item
per prompt (and per sample, with ``n``), the generation ended where SGLang's scheduler ends it, and
the answer written as SGLang writes it (``text`` as its detokenizer trims it, ``meta_info`` with its
keys in its order). Where a generation ends: ``rollout/serve/generation.py``; only ``text`` is
trimmed (``DetokenizerManager.trim_matched_stop``).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from rollout.engines.base import Generation, PartialGeneration, SamplingParams
from rollout.engines.sglang_protocol import OutputOptions, finish_reason_payload, sampling_from_payload
from rollout.serve.admission import (
    check_chars,
    check_count,
    check_prompt_length,
    check_samples,
    check_stops,
    encode_text,
)
from rollout.serve.generation import GenerateItem
from rollout.serve.http import BadRequest

if TYPE_CHECKING:
    from rollout.serve.state import ServerState


# ----- reading the request ---------------------------------------------------------------------------

NUMBER = "a number"
INTEGER = "an integer"
FLAG = "true or false"
TEXT = "a string"
TEXTS = "a string or a list of strings"
IDS = "a list of token ids"
OBJECT = "an object"
SAMPLING_TYPES = {
    "max_new_tokens": INTEGER, "stop": TEXTS, "stop_token_ids": IDS, "stop_regex": TEXTS, "temperature": NUMBER,
    "top_p": NUMBER, "top_k": INTEGER, "min_p": NUMBER, "frequency_penalty": NUMBER, "presence_penalty": NUMBER,
    "repetition_penalty": NUMBER, "min_new_tokens": INTEGER, "n": INTEGER, "json_schema": TEXT, "regex": TEXT,
    "ebnf": TEXT, "structural_tag": TEXT, "ignore_eos": FLAG, "skip_special_tokens": FLAG,
    "spaces_between_special_tokens": FLAG, "no_stop_trim": FLAG, "stream_interval": INTEGER, "logit_bias": OBJECT,
    "sampling_seed": INTEGER, "seed": INTEGER, "custom_params": OBJECT, "beam_width": INTEGER,
}  # fmt: skip
"""The JSON type of every sampling parameter SGLang 0.5.23's ``/generate`` schema knows (``seed`` is
rallyrl's alias of ``sampling_seed``); null is the default of each."""
NOT_SERVED = {"beam_width": "there is no beam search"}
"""Parameters SGLang knows that ``rallyrl serve`` refuses unless null (besides ``UNSUPPORTED_SAMPLING``)."""


def _is(value: Any, kind: str) -> bool:
    if value is None:
        return True
    if kind in (NUMBER, INTEGER):
        return not isinstance(value, bool) and isinstance(value, int if kind == INTEGER else (int, float))
    if kind == FLAG:
        return isinstance(value, bool)
    if kind == TEXT:
        return isinstance(value, str)
    if kind == TEXTS:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == IDS:
        return isinstance(value, list) and all(_is(v, INTEGER) and v is not None for v in value)
    return isinstance(value, dict)


def check_sampling_types(params: Any, name: str = "sampling_params") -> None:
    """SGLang's schema check of ``sampling_params``: each key one it knows, each value of its JSON type
    (a ``contract`` BadRequest naming the field otherwise)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise BadRequest(f"{name}: expected an object (or a list of objects for a batch)", "schema")
    for key, value in params.items():
        if key not in SAMPLING_TYPES:
            raise BadRequest(f"{name}.{key}: not a sampling parameter of SGLang", "contract")
        if not _is(value, SAMPLING_TYPES[key]):
            raise BadRequest(f"{name}.{key}: expected {SAMPLING_TYPES[key]}, got {value!r}", "contract")
        if key in NOT_SERVED and value is not None:
            raise BadRequest(f"{name}.{key}: not supported by rallyrl serve ({NOT_SERVED[key]})")


async def _prompts(server: ServerState, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The token ids of every prompt of a ``/generate`` body, and whether it was a batch."""
    limits = server.config.limits
    if body.get("input_ids") is not None:
        prompts = body["input_ids"]
        if not isinstance(prompts, list):
            raise BadRequest("input_ids: expected a list of token ids (or a list of such lists)", "schema")
        if not prompts:
            raise BadRequest("input_ids: empty (no tokens)")
        batched = isinstance(prompts[0], list)
        prompts = prompts if batched else [prompts]
        check_count("input_ids", len(prompts), limits.max_prompts, "max_prompts")
        for i, ids in enumerate(prompts):
            name = f"input_ids[{i}]" if batched else "input_ids"
            if isinstance(ids, list):
                check_prompt_length(server, len(ids), name)
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise BadRequest(f"{name}: expected a list of token ids", "schema")
            if not ids:
                raise BadRequest(f"{name}: an empty prompt (no tokens)")
            server.check_vocabulary(ids, name)
        return prompts, batched
    texts = body.get("text")
    if texts is None:
        raise BadRequest("give text or input_ids")
    batched = isinstance(texts, list)
    if batched and not texts:
        raise BadRequest("text: an empty list (no prompts)")
    texts = texts if batched else [texts]
    check_count("text", len(texts), limits.max_prompts, "max_prompts")
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest("text: expected a string or a list of strings", "schema")
    for i, text in enumerate(texts):  # every text before any is tokenized
        check_chars(server, len(text), f"text[{i}]" if batched else "text")
    prompts = [await encode_text(server, t, "text") for t in texts]
    if not all(prompts):
        raise BadRequest("text: an empty prompt (no tokens)")
    return prompts, batched


async def generate_items(server: ServerState, body: dict[str, Any]) -> tuple[list[GenerateItem], bool]:
    """One ``GenerateItem`` per prompt (``n`` per prompt, prompt after prompt) of a ``/generate`` body,
    and whether the answer is a list (a batch, or ``n`` above 1). Every count and length is checked
    against ``ServeConfig.limits`` before any work (``admission.py``)."""
    prompts, batched = await _prompts(server, body)
    count = len(prompts)

    def per_prompt(name: str, default: Any) -> list[Any]:
        """A field given once for every prompt or, in a batch, as a list of one value per prompt."""
        value = body.get(name)
        if not isinstance(value, list):
            return [default if value is None else value] * count
        if not batched or len(value) != count:
            raise BadRequest(f"{name}: {len(value)} values for {count} prompt{'s' * (count > 1)}")
        return value

    params = per_prompt("sampling_params", {})
    listed = isinstance(body.get("sampling_params"), list)
    for i, p in enumerate(params):
        name = f"sampling_params[{i}]" if listed else "sampling_params"
        check_sampling_types(p, name)
        check_stops(server, (p or {}).get("stop"), (p or {}).get("stop_token_ids"), f"{name}.")
    logprob = per_prompt("return_logprob", False)
    starts, tops = per_prompt("logprob_start_len", -1), per_prompt("top_logprobs_num", 0)
    if any(start not in (None, -1) for start in starts) or any(tops) or body.get("token_ids_logprob") is not None:
        raise BadRequest("logprob_start_len, top_logprobs_num, token_ids_logprob: rallyrl serve returns the logprob "
                         "of each generated token only (logprob_start_len -1, no top logprobs)")  # fmt: skip
    text_in_logprobs = bool(body.get("return_text_in_logprobs"))
    samples = [1 if (p or {}).get("n") is None else p["n"] for p in params]
    if len(set(samples)) > 1 or samples[0] < 1:
        raise BadRequest(f"sampling_params.n: one positive n for every prompt, got {samples[:8]}")
    n = samples[0]
    check_samples(server, count, n, "sampling_params.n")
    rids = body.get("rid")
    if n > 1 or rids is None:
        rids = [uuid.uuid4().hex for _ in range(count * n)]  # SGLang gives each sample a rid of its own
    elif isinstance(rids, str):
        rids = [f"{rids}_{i}" for i in range(count)] if batched else [rids]
    elif not (isinstance(rids, list) and batched and len(rids) == count):
        raise BadRequest(f"rid: expected a string or a list of {count} request ids for this batch")
    samples_in_order = [(i, ids) for i, ids in enumerate(prompts) for _ in range(n)]  # as SGLang orders them
    items = []
    for (i, ids), rid in zip(samples_in_order, rids, strict=True):
        sampling, options, no_tokens = _sampling(server, params[i], ids)
        items.append(GenerateItem(ids, sampling, options, str(rid), bool(logprob[i]), text_in_logprobs, no_tokens))
    return items, batched or n > 1


def _sampling(
    server: ServerState, params: dict[str, Any] | None, ids: list[int]
) -> tuple[SamplingParams, OutputOptions, bool]:
    """The engine's SamplingParams for one prompt, its OutputOptions, and whether it asks for no
    tokens; a prompt and ``max_new_tokens`` that do not fit the context are refused, as in SGLang."""
    params = {k: v for k, v in (params or {}).items() if k != "n"}
    context = server.context_length
    if context is not None and len(ids) >= context:
        raise BadRequest(f"input_ids: the prompt has {len(ids)} tokens, the context holds {context}")
    wanted = params.get("max_new_tokens")
    if context is not None and isinstance(wanted, int) and len(ids) + wanted > context:
        raise BadRequest(f"sampling_params.max_new_tokens: {len(ids)} prompt tokens + {wanted} new tokens do not "
                         f"fit the context of {context} tokens")  # fmt: skip
    no_tokens = wanted == 0
    if no_tokens:
        params["max_new_tokens"] = 1
    try:
        sampling, options = sampling_from_payload(params, server.eos_token_ids,
                                                  None if context is None else context - len(ids))  # fmt: skip
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return sampling, options, no_tokens



# ----- writing the answer ------------------------------------------------------------------------------


def output_text(tokenizer: Any, generation: Generation | PartialGeneration, options: OutputOptions) -> str:
    """``text`` as SGLang's detokenizer writes it: special tokens skipped unless asked for, the
    matched stop token or stop string cut off unless ``no_stop_trim``."""
    ids = generation.output_ids
    matched = None
    if isinstance(generation, Generation) and generation.finish_reason == "stop" and not options.no_stop_trim:
        matched = generation.meta.get("matched_stop", ids[-1] if ids else None)
    if isinstance(matched, int):
        ids = ids[:-1]
    text = tokenizer.decode(
        ids,
        skip_special_tokens=options.skip_special_tokens,
        spaces_between_special_tokens=options.spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )
    if isinstance(matched, str) and (cut := text.find(matched)) >= 0:
        text = text[:cut]
    return text


def weight_version_spans(generation: Generation, name: Any) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions``: the runs of output tokens made by one weight version, each
    ``{"version": name(v), "start": i, "end": j}`` (one empty run when there are no tokens)."""
    versions = [name(v) for v in generation.token_weight_versions()] or [name(generation.weight_version)]
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": min(i + 1, len(generation.output_ids))})
    return spans


def generate_output(server: ServerState, item: GenerateItem, generation: Generation | PartialGeneration,
                    started: float, first_of_stream: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """One ``/generate`` answer, or one chunk of a stream (``first_of_stream`` True or False), with
    SGLang 0.5.23's ``meta_info`` keys in its order. ``weight_version`` names the version of the last
    token; ``cached_tokens`` is 0 (there is no prefix cache report); ``response_sent_to_client_ts`` is
    on a whole answer and on the first chunk of a stream."""
    finished = isinstance(generation, Generation)
    version = server.version_name(generation.weight_version) if finished else server.version_text()
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish_reason_payload(generation) if finished else None,
        "prompt_tokens": len(item.input_ids),
        "weight_version": version,
        "num_retractions": 0,
    }
    ids = list(generation.output_ids)
    if item.return_logprob:  # SGLang's default logprob_start_len -1: no prompt logprobs
        texts = [server.decode([t]) for t in ids] if item.text_in_logprobs else [None] * len(ids)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [list(t) for t in zip(generation.output_logprobs, ids, texts, strict=True)]
        meta["output_token_logprobs_length"] = len(ids)
    meta |= {"reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0}
    if finished:
        meta["weight_versions"] = weight_version_spans(generation, server.version_name)
    meta |= {"cached_tokens_details": None, "dp_rank": None}
    if finished:
        meta["e2e_latency"] = time.monotonic() - started
    if first_of_stream is not False:
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": output_text(server.tokenizer, generation, item.options), "output_ids": ids, "meta_info": meta}
