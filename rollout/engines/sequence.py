"""What the embedded engine's batch holds: one ``Sequence`` per request, and the engine's counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from rollout.engines.base import Generation, SamplingParams


@dataclass
class Sequence:
    """One request in the batch: its prompt, the tokens so far and where its keys and values are."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Generation]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_weight_versions: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the KV cache (its next position)
    row: int = -1
    finish: str | None = None
    generator: torch.Generator | None = None  # set when the request has its own sampling seed
    progress: asyncio.Queue[int | None] | None = None  # streamed requests: token counts after each step
    stale_kv: bool = False  # its keys and values came (partly) from weights older than the engine's
    error: BaseException | None = None  # its own step failed (its sampling): it ends with this error, alone

    def emit(self, token: int, logprob: float, weight_version: int, max_len: int) -> None:
        """Append one sampled token; set ``finish`` when it was a stop token or the budget is spent."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_weight_versions.append(weight_version)
        if token in self.sampling.stop_token_ids:
            self.finish = "stop"
        elif len(self.output_ids) >= self.sampling.max_new_tokens or self.length + 1 >= max_len:
            self.finish = "length"


@dataclass
class EngineStats:
    """Counters the benchmarks read."""

    steps: int = 0
    prefills: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    busy_s: float = 0.0
    peak_batch: int = 0
    shared_prefix_steps: int = 0  # decode steps that read a prompt prefix shared by every row once
    resumed_sequences: int = 0  # running sequences computed again on new weights after an update
    recomputed_tokens: int = 0  # the tokens of those sequences (prompt and output so far)
