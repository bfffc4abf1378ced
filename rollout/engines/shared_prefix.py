"""Decode attention that reads a prefix shared by every row once, not once per row.

The prompts of a rollout share their system prompt (hundreds of tokens with tool schemas),
and a decode step of a small model on a CPU is bound by reading every row's keys and values.
When all rows of a batch start with the same ``shared_prefix`` tokens (at the same columns of
the KV buffer), their keys and values there are the same, so one row's serve them all: the
scores against the prefix are one matrix product against a single copy, the scores against
each row's own columns a batched one, and a single softmax over both gives the usual result
(cascade attention, as in FlashInfer). Without a ``shared_prefix`` argument, or with more than
one query position (a prefill, where SDPA's fused kernel beats materialising the scores), it
is transformers' SDPA attention unchanged. ``shared_prefix_length`` says how long that prefix is.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rallyrl_shared_prefix"

MIN_SHARED_PREFIX = 64
"""Decode reads a prompt prefix shared by every running sequence once when it is at least this long."""


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Leading tokens all ``prompts`` share, or 0 when fewer than ``MIN_SHARED_PREFIX`` (or one prompt).

    Prompt token i sits in column i of its KV row, so these columns hold the same keys and
    values in every row (``shared_prefix_attention``).
    """
    if len(prompts) < 2:
        return 0
    first = prompts[0]
    low, high = 0, min(len(p) for p in prompts)
    while low < high:  # the longest m with every prompt[:m] == first[:m]
        middle = (low + high + 1) // 2
        if all(p[:middle] == first[:middle] for p in prompts):
            low = middle
        else:
            high = middle - 1
    return low if low >= MIN_SHARED_PREFIX else 0


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    shared_prefix: int = 0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` [rows, heads, 1, dim]; ``key``/``value`` [rows, kv_heads, columns, dim], columns
    ``0 .. shared_prefix`` equal in every row; ``attention_mask`` additive [rows, 1, 1, columns].
    Returns [rows, 1, heads, dim] like transformers' attention functions."""
    if not shared_prefix or query.shape[2] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # the query heads of each kv head
    p = shared_prefix
    shared_scores = torch.einsum("rkgd,kpd->rkgp", q, key[0, :, :p]) * scale
    own_scores = torch.matmul(q, key[:, :, p:].transpose(-1, -2)) * scale
    if attention_mask is not None:  # the prompt columns of the prefix are valid in every row
        own_scores = own_scores + attention_mask[:, :, :, p:]
    weights = torch.softmax(torch.cat([shared_scores, own_scores], dim=-1), dim=-1, dtype=torch.float32)
    weights = weights.to(value.dtype)
    out = torch.einsum("rkgp,kpd->rkgd", weights[..., :p], value[0, :, :p])
    out = out + torch.matmul(weights[..., p:], value[:, :, p:])
    return out.reshape(rows, 1, heads, dim), None


AttentionInterface.register(NAME, shared_prefix_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
