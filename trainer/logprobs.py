"""Token logprobs and entropy from final hidden states, in token chunks through the LM head.

A real vocabulary makes the logits the largest tensor of a training step: 8,192 tokens x
151,936 (Qwen2.5) x 4 bytes is 5 GB per float32 copy, and ``log_softmax`` + entropy make several.
Here no ``[tokens, vocab]`` tensor outlives its chunk: the forward keeps, per token, only the
log-normaliser (logsumexp), and the backward recomputes each chunk's logits from the hidden
states and the head's weight, turns them into ``d logprob / d logits`` in place
(``onehot(target) - softmax``) and multiplies back into the gradients of the hidden states and the
weight. The entropy (a metric) is computed chunk by chunk in the forward, without gradient.

Matrix products run in the compute dtype (the autocast dtype where autocast is on, else the
weight's dtype, as ``lm_head`` would) and the softmax arithmetic in float32, as the unchunked
computation (``unchunked_logprobs``, kept as the reference) does on its float32 copy of the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype ``lm_head`` would multiply in: the autocast dtype where autocast is on."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """float32 logits ``[C, V]`` of one chunk, divided by the temperature (in place)."""
    logits = (hidden @ weight.T).float()
    if bias is not None:
        logits += bias.float()
    if temperature != 1.0:
        logits /= temperature
    return logits


def _entropy_of_log_probs(logp: Tensor) -> Tensor:
    """``-sum p log p`` per row of float32 log-probabilities (``-inf`` entries contribute 0), with
    one temporary of their size."""
    terms = logp.exp()
    terms *= logp
    terms.nan_to_num_(nan=0.0)  # 0 * -inf
    return -terms.sum(-1)


def _forward_chunks(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                    chunk: int, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Per token: the logprob of its target, the log-normaliser, and (optionally) the entropy."""
    count = hidden.shape[0]
    logprobs = torch.empty(count, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs) if with_entropy else None
    for start in range(0, count, chunk):
        end = min(start + chunk, count)
        logits = _chunk_logits(hidden[start:end], weight, bias, temperature)
        lse[start:end] = norm = logits.logsumexp(-1)
        logits -= norm[:, None]  # now log-probabilities
        logprobs[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1)
        if entropy is not None:
            entropy[start:end] = _entropy_of_log_probs(logits)
        del logits
    return logprobs, lse, entropy


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``logprobs[i] = log softmax(hidden[i] @ weight.T / T)[targets[i]]`` with recomputation in backward."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                temperature: float, chunk: int, with_entropy: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
        dtype = compute_dtype(weight)
        with torch.autocast(weight.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            logprobs, lse, entropy = _forward_chunks(h, w, bias, targets, temperature, chunk, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        if entropy is None:
            entropy = logprobs.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor, _grad_entropy: Tensor) -> tuple:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        with torch.autocast(weight.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                # d logprob / d logits = onehot(target) - softmax, times the incoming gradient / T
                grad = _chunk_logits(h[start:end], w, bias, temperature)
                grad -= lse[start:end, None]
                grad.exp_()
                scale = grad_logprobs[start:end].float() / temperature
                grad *= -scale[:, None]
                grad.scatter_add_(-1, targets[start:end, None], scale[:, None])
                if grad_bias is not None:
                    grad_bias += grad.sum(0)
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (grad.T @ h[start:end]).float()
                del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                     temperature: float = 1.0, chunk_tokens: int = 1024,
                     with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Float32 logprobs ``[M]`` of ``targets [M]`` under ``hidden [M, H] @ weight.T (+ bias)``,
    divided by ``temperature``, and the entropy ``[M]`` of each softmax (no gradient) when asked.

    At most ``chunk_tokens`` rows of logits exist at a time; 0 computes them all at once
    (``unchunked_logprobs``, a reference).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        shapes = f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        raise ValueError(f"expected hidden [M, H] and targets [M], got {shapes}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy rollouts are trained at 1.0), got {temperature}")
    if chunk_tokens == 0:
        return unchunked_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                  with_entropy=with_entropy)  # fmt: skip
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    targets = targets.long()
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        dtype = compute_dtype(weight)
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            logprobs, _, entropy = _forward_chunks(hidden.to(dtype), weight.to(dtype), bias, targets, temperature,
                                                   chunk_tokens, with_entropy)  # fmt: skip
        return logprobs, entropy
    logprobs, entropy = _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, temperature, chunk_tokens,
                                                    with_entropy)  # fmt: skip
    return logprobs, entropy if with_entropy else None


def unchunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                       temperature: float = 1.0, with_entropy: bool = False,
                       ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The computation before chunking, kept as the reference of tests: the whole ``[M, V]`` logits
    through ``F.linear`` (autocast applies), then ``full_logits_logprobs`` on every row, every
    intermediate kept for autograd."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    every_row = torch.arange(logits.shape[0], device=logits.device)
    return full_logits_logprobs(logits, every_row, targets, temperature, with_entropy)


def full_logits_logprobs(logits: Tensor, positions: Tensor, targets: Tensor, temperature: float = 1.0,
                         with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The computation before chunking, from the model's logits ``[N, V]`` of every position: divided
    by the temperature, a float32 ``log_softmax`` and an entropy over all of them, then the rows at
    ``positions``. ``logprob_chunk_tokens: 0`` selects it, as the reference row of
    ``benchmarks/trainer_memory.py`` and of the tests."""
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.float().log_softmax(-1)
    logprobs = logp.index_select(0, positions).gather(-1, targets.long()[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = _entropy_of_log_probs(logits.float().log_softmax(-1)).index_select(0, positions)
    return logprobs, entropy
