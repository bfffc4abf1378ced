"""A KV cache for continuous batching: one preallocated buffer per layer, one row per sequence.

Rows are dense (``0 .. num_rows``): a sequence that leaves is replaced by the last row.
Columns are shared: every decode step writes one new column for all rows, and a row's
valid columns are marked in ``mask`` (a joining sequence is prefilled into columns
``0 .. len(prompt)`` and then decodes at the shared write column, leaving a masked gap).
When the gaps grow, ``compact`` moves each row's valid columns to the front.
Keys are stored after rotary embedding, so gaps do not disturb positions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class KVBuffer:
    """Per-layer key/value buffers of shape [rows, kv_heads, cols, head_dim] plus a [rows, cols] mask."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.num_rows = 0  # rows in use
        self.width = 0  # columns in use (the next decode step writes column ``width``)
        self._allocate(16, 256)

    @property
    def row_capacity(self) -> int:
        return self.mask.shape[0]

    @property
    def col_capacity(self) -> int:
        return self.mask.shape[1]

    def _allocate(self, rows: int, cols: int) -> None:
        """Grow the buffers to at least ``rows`` x ``cols``, keeping the contents."""
        shape = (rows, self.kv_heads, cols, self.head_dim)
        old_rows, old_cols = self.mask.shape
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer < len(store):
                    new[:old_rows, :, :old_cols] = store[layer]
                    store[layer] = new
                else:
                    store.append(new)
        mask = torch.zeros(rows, cols, dtype=torch.bool, device=self.device)
        mask[:old_rows, :old_cols] = self.mask
        self.mask = mask

    def reserve(self, rows: int, cols: int) -> None:
        """Make room for ``rows`` rows and ``cols`` columns (doubling, to amortise copies)."""
        if rows <= self.row_capacity and cols <= self.col_capacity:
            return
        new_rows = self.row_capacity
        while new_rows < rows:
            new_rows *= 2
        new_cols = self.col_capacity
        while new_cols < cols:
            new_cols *= 2
        self._allocate(new_rows, new_cols)

    def remove_row(self, row: int) -> int | None:
        """Drop ``row`` by moving the last row into it; returns the moved row's old index (or None)."""
        last = self.num_rows - 1
        moved = None
        if row != last:
            for layer in range(self.num_layers):
                self.keys[layer][row] = self.keys[layer][last]
                self.values[layer][row] = self.values[layer][last]
            self.mask[row] = self.mask[last]
            moved = last
        self.mask[last] = False
        self.num_rows -= 1
        if self.num_rows == 0:
            self.width = 0
        return moved

    def compact(self) -> None:
        """Move every row's valid columns to the front, shrinking ``width`` to the longest row."""
        rows, width = self.num_rows, self.width
        if rows == 0 or width == 0:
            self.width = 0
            return
        mask = self.mask[:rows, :width]
        counts = mask.sum(dim=1)
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid columns first, in order
        new_width = int(counts.max())
        index = order[:, None, :new_width, None].expand(rows, self.kv_heads, new_width, self.head_dim)
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                moved = torch.gather(store[layer][:rows, :, :width], 2, index)
                store[layer][:rows, :, :new_width] = moved
        self.mask[:rows, :width] = False
        self.mask[:rows, :new_width] = torch.arange(new_width, device=self.device)[None, :] < counts[:, None]
        self.width = new_width

    def view(self, rows: slice, start: int) -> _BufferView:
        """A transformers ``Cache`` writing new keys at column ``start`` of ``rows``."""
        return _BufferView(self, rows, start)


class _BufferView(Cache):
    """The ``Cache`` the model sees for one forward: writes in place, returns columns ``0 .. start+q``."""

    def __init__(self, buffer: KVBuffer, rows: slice, start: int):
        super().__init__(layers=[])
        self.buffer, self.rows, self.start = buffer, rows, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        end = self.start + key_states.shape[-2]
        keys, values = self.buffer.keys[layer_idx], self.buffer.values[layer_idx]
        keys[self.rows, :, self.start : end] = key_states
        values[self.rows, :, self.start : end] = value_states
        return keys[self.rows, :, :end], values[self.rows, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.start + query_length, 0
