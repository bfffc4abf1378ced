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
from collections.abc import Awaitable, Callable, Container, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rollout.engines.base import EngineError, Generation, SamplingParams

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


@dataclass(frozen=True)
class OutputOptions:
    """What a ``/generate`` request's ``sampling_params`` ask of a server beyond the engine's
    ``SamplingParams``, with SGLang's defaults: the stop strings and how ``text`` is written.
    ``output_ids`` and their logprobs are never trimmed (as in SGLang)."""

    stop: tuple[str, ...] = ()
    """Strings that end the generation at the token that completes one (SGLang's ``stop``)."""
    skip_special_tokens: bool = True
    """Leave special tokens (``<|im_end|>``) out of ``text``."""
    spaces_between_special_tokens: bool = True
    """Passed to the tokenizer's ``decode`` (slow tokenizers only put spaces there)."""
    no_stop_trim: bool = False
    """Keep the matched stop token or stop string in ``text`` (by default it is cut off)."""


UNSUPPORTED_SAMPLING: dict[str, tuple[Any, str]] = {
    "min_new_tokens": (0, "the engine cannot hold back its stop tokens"),
    "n": (1, "send the prompt n times in a batch instead"),
    "min_p": (0.0, "the engine samples with temperature, top_p and top_k only"),
    "frequency_penalty": (0.0, "the engine applies no penalties"),
    "presence_penalty": (0.0, "the engine applies no penalties"),
    "repetition_penalty": (1.0, "the engine applies no penalties"),
    "logit_bias": (None, "the engine applies no logit bias"),
    "json_schema": (None, "there is no constrained decoding"),
    "regex": (None, "there is no constrained decoding"),
    "ebnf": (None, "there is no constrained decoding"),
    "structural_tag": (None, "there is no constrained decoding"),
    "stop_regex": (None, "use stop strings"),
    "custom_params": (None, "there are no custom logit processors"),
    "stream_interval": (1, "streams send every decode step"),
}
"""SGLang sampling parameters ``rallyrl serve`` does not implement: the one value accepted (SGLang's
default, which changes nothing; ``None`` is accepted too) and why others are refused."""

SUPPORTED_SAMPLING = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed", "seed", "stop",
     "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
)  # fmt: skip


def sampling_from_payload(
    params: dict[str, Any] | None, eos_token_ids: Sequence[int] = (), context_length: int | None = None
) -> tuple[SamplingParams, OutputOptions]:
    """A server's reading of ``sampling_params`` with SGLang's defaults (``null`` means the default):
    the engine stops at ``stop_token_ids`` and at the model's ``eos_token_ids`` unless ``ignore_eos``
    (which, as in SGLang, disables both); ``max_new_tokens`` null runs to ``context_length``.
    Raises ValueError naming the field that is malformed or asks for what this server does not do."""
    params = params or {}
    if not isinstance(params, dict):
        raise ValueError("sampling_params: expected an object")
    for name in params:
        if name not in SUPPORTED_SAMPLING and name not in UNSUPPORTED_SAMPLING:
            raise ValueError(f"sampling_params.{name}: not a sampling parameter of SGLang")
    for name, (default, why) in UNSUPPORTED_SAMPLING.items():
        value = params.get(name)
        if not _changes_nothing(value, default):
            accepted = "null" if default is None else repr(default)
            raise ValueError(
                f"sampling_params.{name}: only {accepted} is supported by rallyrl serve ({why}), got {value!r}"
            )
    stop = params.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise ValueError("sampling_params.stop_token_ids: expected a list of token ids")
    seed = params.get("sampling_seed", params.get("seed"))

    def number(name: str, kind: type, default: Any) -> Any:
        value = params.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            expected = "an integer" if kind is int else "a number"
            raise ValueError(f"sampling_params.{name}: expected {expected}, got {value!r}")
        return kind(value)

    def flag(name: str, default: bool) -> bool:
        value = params.get(name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"sampling_params.{name}: expected true or false, got {value!r}")
        return default if value is None else value

    if params.get("max_new_tokens") is None and context_length is not None:
        params = {**params, "max_new_tokens": context_length}  # SGLang: as many as the context holds
    values = {
        "max_new_tokens": number("max_new_tokens", int, 128),
        "temperature": number("temperature", float, 1.0),
        "top_p": number("top_p", float, 1.0),
        "top_k": number("top_k", int, -1),
        "seed": None if seed is None else number("sampling_seed" if "sampling_seed" in params else "seed", int, 0),
    }
    if values["top_k"] == 0 or values["top_k"] < -1:
        raise ValueError(f"sampling_params.top_k: must be -1 (no cut) or at least 1, got {values['top_k']}")
    stops = params.get("stop")
    stops = [] if stops is None else [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"sampling_params.stop: expected a string or a list of non-empty strings, got {stops!r}")
    options = OutputOptions(
        stop=tuple(stops),
        skip_special_tokens=flag("skip_special_tokens", True),
        spaces_between_special_tokens=flag("spaces_between_special_tokens", True),
        no_stop_trim=flag("no_stop_trim", False),
    )
    stop_token_ids = [] if flag("ignore_eos", False) else list(dict.fromkeys([*stop, *eos_token_ids]))
    try:
        return SamplingParams(stop_token_ids=stop_token_ids, **values), options
    except ValueError as exc:
        raise ValueError(f"sampling_params: {exc}") from None


def _changes_nothing(value: Any, default: Any) -> bool:
    """Whether a sampling parameter's value asks for nothing beyond SGLang's default."""
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    return value in ({}, []) if default is None else value == default


def parse_weight_version(value: Any) -> int | None:
    """SGLang reports weight versions as strings: "default" before any update (None here), then
    whatever the updater named them; "7" and "step_7" both read as 7."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    text = str(value)
    known = _VERSIONS.get(text, False)
    if known is not False:
        return known  # type: ignore[return-value]
    match = re.search(r"(\d+)$", text)
    version = int(match.group(1)) if match else None
    if len(_VERSIONS) < 1024:
        _VERSIONS[text] = version
    return version


_VERSIONS: dict[str, int | None] = {}
"""Weight version strings read so far (a server reports the same one on every response)."""


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
    if not isinstance(output_ids, list) or not set(map(type, output_ids)) <= _INT:
        raise EngineError(f"{where}: output_ids must be a list of token ids")
    if not isinstance(triples, list):
        raise EngineError(f"{where}: meta_info.output_token_logprobs missing (was return_logprob sent?)")
    if len(triples) != len(output_ids):
        raise EngineError(f"{where}: {len(triples)} output_token_logprobs for {len(output_ids)} output_ids")
    logprobs: list[Any] | None = None
    try:  # [logprob, token_id, text] lists that name the output ids, in order (else the slow path says what)
        if [triple[1] for triple in triples] == output_ids:
            logprobs = [triple[0] for triple in triples]
    except (TypeError, IndexError, KeyError):
        pass
    if logprobs is None or not set(map(type, logprobs)) <= _FLOAT:
        logprobs = _checked_logprobs(triples, output_ids, where)
    version = parse_weight_version(meta.get("weight_version", obj.get("weight_version")))
    version = default_version if version is None else version
    meta = dict(meta)
    meta.pop("output_token_logprobs", None)
    meta.pop("input_token_logprobs", None)
    return Generation(output_ids, logprobs, finish_type, version, meta)


_INT, _FLOAT = frozenset({int}), frozenset({float})


def _checked_logprobs(triples: list[Any], output_ids: list[int], where: str) -> list[float]:
    """The logprobs of ``triples`` one by one, naming the first that is not ``[logprob, output_ids[i], ...]``."""
    logprobs: list[float] = []
    for i, (triple, token) in enumerate(zip(triples, output_ids, strict=True)):
        if not isinstance(triple, (list, tuple)) or len(triple) < 2 or triple[1] != token:
            raise EngineError(f"{where}: output_token_logprobs[{i}] {triple!r} does not match output_ids[{i}]")
        try:
            logprobs.append(float(triple[0]))
        except (TypeError, ValueError):
            raise EngineError(f"{where}: output_token_logprobs[{i}] {triple!r}: the logprob is not a number") from None
    return logprobs


def finish_reason_payload(generation: Generation, message: str = "") -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` object for a finished generation."""
    if generation.finish_reason == "stop":  # the stop string matched, else the stop token
        matched = generation.meta.get("matched_stop")
        if matched is None and generation.output_ids:
            matched = generation.output_ids[-1]
        return {"type": "stop", "matched": matched}
    if generation.finish_reason == "length":
        return {"type": "length", "length": len(generation.output_ids)}
    return {"type": "abort", "message": message or "Aborted", "status_code": None, "err_type": None}


def resumable(part: Generation, rid: str, aborted_by_us: Container[str]) -> bool:
    """Whether a generation was aborted by someone else (a weight update), so it goes on."""
    return part.finish_reason == "abort" and rid not in aborted_by_us


def settled(part: Generation, sampling: SamplingParams) -> Generation:
    """A generation that was not resumed, as ``generate_resuming`` returns it (changed in place)."""
    if part.finish_reason == "length" and part.output_ids and part.output_ids[-1] in sampling.stop_token_ids:
        part.finish_reason = "stop"
    part.meta = {**part.meta, "resumes": 0}
    part.output_weight_versions = part.token_weight_versions()
    return part


async def generate_resuming(
    generate_once: Callable[[list[int], SamplingParams], Awaitable[Generation]],
    input_ids: list[int],
    sampling: SamplingParams,
    aborted_by_us: Container[str],
    rid: str,
    max_resumes: int,
    first: Generation | None = None,
) -> Generation:
    """Generate, resuming across aborts we did not ask for (a weight update paused the server):
    each resume continues from the tokens so far with the rest of the budget, and every token
    keeps the weight version that produced it. An abort that used the whole budget is "length".
    SGLang checks the length before the stop tokens, so a stop token in the last allowed slot comes
    back as "length": it is reported as the "stop" it is, as the embedded engine does. ``first``: the
    first call's result, where the caller made it."""
    part = first if first is not None else await generate_once(input_ids, sampling)
    if not resumable(part, rid, aborted_by_us):  # nearly every call: the part is the generation
        return settled(part, sampling)
    output_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    resumes = 0
    while True:
        output_ids += part.output_ids
        logprobs += part.output_logprobs
        versions += part.token_weight_versions()
        finish = part.finish_reason
        goes_on = resumable(part, rid, aborted_by_us)
        if goes_on and len(output_ids) >= sampling.max_new_tokens:
            finish, goes_on = "length", False
        if not goes_on or resumes >= max_resumes:
            if finish == "length" and output_ids and output_ids[-1] in sampling.stop_token_ids:
                finish = "stop"
            return Generation(
                output_ids, logprobs, finish, part.weight_version,
                meta={**part.meta, "resumes": resumes}, output_weight_versions=versions,
            )  # fmt: skip
        resumes += 1
        if output_ids:  # a resume: the rest of the budget after the tokens so far
            budget = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(output_ids))
            part = await generate_once(input_ids + output_ids, budget)
        else:
            part = await generate_once(input_ids, sampling)
