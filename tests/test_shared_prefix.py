"""Shared-prefix decode attention equals SDPA over the full keys and values."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rollout.engines.shared_prefix import shared_prefix_attention


class Attention(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def shared_batch(rows: int, kv_heads: int, groups: int, columns: int, prefix: int, queries: int = 1):
    torch.manual_seed(rows * 100 + groups)
    query = torch.randn(rows, kv_heads * groups, queries, 16)
    key, value = torch.randn(rows, kv_heads, columns, 16), torch.randn(rows, kv_heads, columns, 16)
    key[:, :, :prefix], value[:, :, :prefix] = key[0, :, :prefix], value[0, :, :prefix]
    mask = torch.zeros(rows, 1, queries, columns)
    mask[1, ..., columns - 7 :] = torch.finfo(torch.float32).min  # a shorter row
    mask[2, ..., prefix + 3] = torch.finfo(torch.float32).min  # a gap in a row's own columns
    return query, key, value, mask


@pytest.mark.parametrize("groups", [1, 4])
def test_decode_over_a_shared_prefix_equals_sdpa_over_every_column(groups):
    query, key, value, mask = shared_batch(rows=5, kv_heads=2, groups=groups, columns=50, prefix=30)
    module = Attention(groups)
    shared, _ = shared_prefix_attention(module, query, key, value, mask, scaling=0.25, shared_prefix=30)
    full, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert shared.shape == full.shape == (5, 1, 2 * groups, 16)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)


def test_without_a_shared_prefix_or_with_several_queries_it_is_sdpa():
    query, key, value, mask = shared_batch(rows=3, kv_heads=2, groups=1, columns=20, prefix=10, queries=4)
    module = Attention(1)
    full, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    for prefix in (0, 10):
        out, _ = shared_prefix_attention(module, query, key, value, mask, scaling=0.25, shared_prefix=prefix)
        torch.testing.assert_close(out, full)
