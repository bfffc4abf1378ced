"""SGLang's native ``/generate`` protocol in both directions: the request a client sends for
``SamplingParams`` and the ``Generation`` it reads back. The HTTP client, the in-process
adapter and ``rallyrl serve`` all go through these functions, so the three agree on names.

A response looks like (other keys are tolerated)::

    {"text": "...", "output_ids": [..],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": 151645},
                   "output_token_logprobs": [[logprob, token_id, text_or_null], ...],
                   "weight_version": "3", "prompt_tokens": .., "completion_tokens": ..}}
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Container
from dataclasses import replace
from typing import Any

from rollout.engines.base import EngineError, Generation, PartialGeneration, SamplingParams

FINISH_TYPES = ("stop", "length", "abort")


def sampling_params_payload(sampling: SamplingParams) -> dict[str, Any]:
    """``sampling_params`` of a ``/generate`` request: the stop token kept in the output, special
    tokens kept in the text, so that output ids are exactly what the model sampled."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def generate_payload(input_ids: list[int], sampling: SamplingParams, rid: str) -> dict[str, Any]:
    """The body of one ``/generate`` request by token ids, with output logprobs."""
    return {
        "input_ids": input_ids,
        "sampling_params": sampling_params_payload(sampling),
        "return_logprob": True,
        "rid": rid,
        "stream": False,
    }


def sampling_from_payload(params: dict[str, Any] | None) -> SamplingParams:
    """The inverse of ``sampling_params_payload`` for a server; unknown keys are ignored.
    Raises ValueError naming the bad field."""
    params = params or {}
    if not isinstance(params, dict):
        raise ValueError("sampling_params: expected an object")
    stop = params.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
        raise ValueError("sampling_params.stop_token_ids: expected a list of token ids")
    seed = params.get("sampling_seed", params.get("seed"))

    def number(name: str, kind: type, default: Any) -> Any:
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            expected = "an integer" if kind is int else "a number"
            raise ValueError(f"sampling_params.{name}: expected {expected}, got {value!r}")
        return kind(value)

    values = {
        "max_new_tokens": number("max_new_tokens", int, 128),
        "temperature": number("temperature", float, 1.0),
        "top_p": number("top_p", float, 1.0),
        "top_k": number("top_k", int, -1),
        "seed": None if seed is None else number("sampling_seed" if "sampling_seed" in params else "seed", int, 0),
    }
    try:
        return SamplingParams(stop_token_ids=stop, **values)
    except ValueError as exc:
        raise ValueError(f"sampling_params: {exc}") from None


def parse_weight_version(value: Any) -> int | None:
    """SGLang reports weight versions as strings: "default" before any update (None here), then
    whatever the updater named them; "7" and "step_7" both read as 7."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    match = re.search(r"(\d+)$", str(value))
    return int(match.group(1)) if match else None


def parse_generation(obj: Any, where: str, default_version: int = 0) -> Generation:
    """A ``Generation`` from one ``/generate`` response object; ``where`` (server and rid) is
    named in the EngineError raised for a malformed response."""
    if not isinstance(obj, dict):
        raise EngineError(f"{where}: expected a JSON object from /generate, got {type(obj).__name__}")
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"{where}: response has no meta_info object")
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in FINISH_TYPES:
        raise EngineError(f"{where}: meta_info.finish_reason {finish!r} is not stop, length or abort")
    output_ids = obj.get("output_ids")
    triples = meta.get("output_token_logprobs")
    if output_ids is None and isinstance(triples, list):  # some versions omit output_ids
        output_ids = [t[1] for t in triples]
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise EngineError(f"{where}: output_ids must be a list of token ids")
    if not isinstance(triples, list):
        raise EngineError(f"{where}: meta_info.output_token_logprobs missing (was return_logprob sent?)")
    if len(triples) != len(output_ids):
        raise EngineError(f"{where}: {len(triples)} output_token_logprobs for {len(output_ids)} output_ids")
    logprobs: list[float] = []
    for i, (triple, token) in enumerate(zip(triples, output_ids, strict=True)):
        if not isinstance(triple, (list, tuple)) or len(triple) < 2 or triple[1] != token:
            raise EngineError(f"{where}: output_token_logprobs[{i}] {triple!r} does not match output_ids[{i}]")
        logprobs.append(float(triple[0]))
    version = parse_weight_version(meta.get("weight_version", obj.get("weight_version")))
    version = default_version if version is None else version
    return Generation(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=finish_type,
        weight_version=version,
        meta={k: v for k, v in meta.items() if k not in ("output_token_logprobs", "input_token_logprobs")},
    )


def generate_response(
    input_ids: list[int],
    generation: Generation | PartialGeneration,
    rid: str,
    text: str,
    weight_version: str,
    logprob: bool,
    latency: float,
) -> dict[str, Any]:
    """One ``/generate`` result object as SGLang's server builds it (what ``parse_generation`` reads);
    a ``PartialGeneration`` (a streamed chunk) has no finish reason yet."""
    finished = isinstance(generation, Generation)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_payload(generation) if finished else None,
        "prompt_tokens": len(input_ids),
        "weight_version": weight_version,
        "total_retractions": 0,
    }
    if logprob:  # SGLang's default logprob_start_len=-1: only the last prompt token, without a logprob
        meta["input_token_logprobs"] = [[None, input_ids[-1], None]]
        meta["output_token_logprobs"] = [
            [lp, token, None] for lp, token in zip(generation.output_logprobs, generation.output_ids, strict=True)
        ]
    meta["completion_tokens"] = len(generation.output_ids)
    meta["cached_tokens"] = 0
    if finished:
        meta["e2e_latency"] = latency
    return {"text": text, "output_ids": list(generation.output_ids), "meta_info": meta}


def finish_reason_payload(generation: Generation, message: str = "") -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` object for a finished generation."""
    if generation.finish_reason == "stop":
        return {"type": "stop", "matched": generation.output_ids[-1] if generation.output_ids else None}
    if generation.finish_reason == "length":
        return {"type": "length", "length": len(generation.output_ids)}
    return {"type": "abort", "message": message or "Aborted", "status_code": None, "err_type": None}


async def generate_resuming(
    generate_once: Callable[[list[int], SamplingParams], Awaitable[Generation]],
    input_ids: list[int],
    sampling: SamplingParams,
    aborted_by_us: Container[str],
    rid: str,
    max_resumes: int,
) -> Generation:
    """Generate, resuming across aborts we did not ask for (a weight update paused the server):
    each resume continues from the tokens so far with the rest of the budget, and every token
    keeps the weight version that produced it. An abort that used the whole budget is "length"."""
    output_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    resumes = 0
    while True:
        budget = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(output_ids))
        part = await generate_once(input_ids + output_ids, budget)
        output_ids += part.output_ids
        logprobs += part.output_logprobs
        versions += part.token_weight_versions()
        finish = part.finish_reason
        resumable = finish == "abort" and rid not in aborted_by_us
        if resumable and len(output_ids) >= sampling.max_new_tokens:
            finish, resumable = "length", False
        if not resumable or resumes >= max_resumes:
            return Generation(
                output_ids, logprobs, finish, part.weight_version,
                meta={**part.meta, "resumes": resumes}, output_weight_versions=versions,
            )  # fmt: skip
        resumes += 1
