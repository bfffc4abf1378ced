"""A generation ended where SGLang 0.5.23's scheduler ends it (``Req.check_finished`` in
``schedule_batch.py``): ``max_new_tokens`` reached ("length", even when that token is a stop token),
then a stop token (``stop_token_ids`` or one of the model's EOS ids, both off with ``ignore_eos``),
then a stop string in the text so far. ``output_ids`` and their logprobs keep every token, the stop
token included. Shared by ``rallyrl serve``'s routes and the agent gateway."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rollout.engines.base import Engine, Generation, PartialGeneration, SamplingParams, StreamsGenerations
from rollout.engines.sglang_protocol import OutputOptions
from rollout.serve.http import model_config


@dataclass
class GenerateItem:
    """One prompt (one sample of it, with ``n``) of a ``/generate`` request and what was asked for it."""

    input_ids: list[int]
    sampling: SamplingParams
    options: OutputOptions
    rid: str
    return_logprob: bool
    text_in_logprobs: bool = False
    """``return_text_in_logprobs``: each logprob triple carries its token's text."""
    no_tokens: bool = False
    """``max_new_tokens`` 0: answered at once with no output (the engine is not asked)."""


def eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The ids that end a generation unless ``ignore_eos``, gathered as SGLang does: ``eos_token_id``
    of the model's ``config.json`` and ``generation_config.json`` (an id or a list of ids) and the
    tokenizer's ``eos_token_id``."""
    ids: list[int] = []
    for config in (model_config(model_path), model_config(model_path, "generation_config.json")):
        value = config.get("eos_token_id")
        ids += [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))



async def generate_chunks(
    engine: Engine, tokenizer: Any, input_ids: list[int], sampling: SamplingParams, rid: str,
    stop: Sequence[str] = (), stream: bool = False,
) -> AsyncIterator[PartialGeneration | Generation]:  # fmt: skip
    """The generation as SGLang ends it: with ``stream``, the tokens so far after each decode step
    (when the engine streams), the final ``Generation`` last. A stop string ends it at the token
    that completes it (the engine's generation of the rest is aborted)."""
    streams = isinstance(engine, StreamsGenerations)
    if not stop and not (stream and streams):  # the plain path: exactly the engine's generation
        yield _length_first(await engine.generate(input_ids, sampling, rid), sampling)
        return
    chunks = engine.generate_stream(input_ids, sampling, rid) if streams else _whole(engine, input_ids, sampling, rid)
    matcher = StopStrings(tokenizer, stop)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            count = len(chunk.output_ids)
            if isinstance(chunk, Generation) and chunk.finish_reason in ("stop", "length"):
                count -= 1  # its last token ended it before a stop string could (SGLang's order)
            found = matcher.search(chunk.output_ids, min(count, sampling.max_new_tokens - 1)) if stop else None
            if found is not None:
                end, matched = found
                versions = chunk.output_weight_versions if isinstance(chunk, Generation) else None
                yield Generation(
                    chunk.output_ids[:end], chunk.output_logprobs[:end], "stop", getattr(chunk, "weight_version", 0),
                    meta={"matched_stop": matched}, output_weight_versions=versions[:end] if versions else None,
                )  # fmt: skip
                return
            yield _length_first(chunk, sampling) if isinstance(chunk, Generation) else chunk


class StopStrings:
    """Finds the first token whose text completes a stop string; like SGLang, each token is checked
    against the text of the last few tokens (as many as the longest stop string can take, plus one)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.window = 1 + max((max(len(s), len(tokenizer.encode(s, add_special_tokens=False))) for s in stop),
                              default=0)  # fmt: skip
        self.checked = 0  # tokens already known not to complete a stop string

    def search(self, output_ids: list[int], limit: int) -> tuple[int, str] | None:
        """(tokens up to and including the one that completes a stop string, that string), looking
        at the first ``limit`` tokens; None when none does."""
        for end in range(self.checked + 1, limit + 1):
            tail = self.tokenizer.decode(output_ids[max(0, end - self.window) : end], skip_special_tokens=False)
            for stop in self.stop:
                if stop in tail:
                    return end, stop
        self.checked = max(self.checked, limit)
        return None


def _length_first(generation: Generation, sampling: SamplingParams) -> Generation:
    """SGLang checks the length before the stop tokens: a stop token as the last of ``max_new_tokens``
    tokens ends the generation with "length"."""
    if generation.finish_reason == "stop" and len(generation.output_ids) >= sampling.max_new_tokens:
        return replace(generation, finish_reason="length")
    return generation


async def _whole(engine: Engine, input_ids: list[int], sampling: SamplingParams, rid: str) -> AsyncIterator[Generation]:
    """An engine that does not stream: its whole generation as one chunk."""
    yield await engine.generate(input_ids, sampling, rid)
