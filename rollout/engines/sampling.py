"""Token sampling for the embedded engine: temperature, top-k and top-p over a batch of logits,
one token per row, with the logprob a trainer recomputes."""

from __future__ import annotations

import torch

from rollout.engines.base import SamplingParams

GREEDY_BELOW = 1e-6
"""Temperatures below this sample greedily (SGLang's ``_SAMPLING_EPS``): dividing the logits by them
would overflow to inf and fail the whole batch's step."""


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generator: torch.Generator,
    row_generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids, their logprobs under logits / temperature).
    Rows with their own generator in ``row_generators`` draw from it, the rest from ``generator``."""
    logits = logits.float()
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temps < GREEDY_BELOW  # as SGLang: a temperature this small would overflow the division
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    tokens = logprobs.argmax(dim=-1)
    if not bool(greedy.all()):
        probs = logprobs.exp()
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            probs = _filter_top_k_top_p(probs, top_k, top_p)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        for row, own in enumerate(row_generators or []):
            if own is not None:
                sampled[row] = torch.multinomial(probs[row], 1, generator=own)[0]
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _filter_top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=probs.device)  # any int64
    ps = torch.tensor(top_p, device=probs.device)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    cumulative = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass before each token
    keep = (ranks < ks[:, None]) & (cumulative < ps[:, None])
    keep[:, 0] = True
    filtered = torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=-1, keepdim=True)
