"""A KV cache for continuous batching: one preallocated buffer per layer, one row per sequence.

Rows are dense (``0 .. num_rows``): a sequence that leaves is replaced by the last row.
Columns are shared: every decode step writes one new column for all rows, and a row's
valid columns are marked in ``mask`` (a joining sequence is prefilled into columns
``0 .. len(prompt)`` and then decodes at the shared write column, leaving a masked gap).
When the gaps grow, ``compact`` moves each row's valid columns to the front.
Keys are stored after rotary embedding, so gaps do not disturb positions.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

INITIAL_SHAPE = (16, 256)
"""Rows and columns the buffer starts with, and shrinks back to once it is empty (``shrink``)."""


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
        self._allocate(*INITIAL_SHAPE)

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

    @torch.inference_mode()
    def clear(self) -> None:
        """Forget every row (the buffers were made in inference mode, so reset them in it)."""
        self.mask.zero_()
        self.num_rows = self.width = 0

    @torch.inference_mode()
    def shrink(self) -> bool:
        """Once no row is in use, give back what a burst grew the buffers to (back to ``INITIAL_SHAPE``);
        whether there was anything to give back."""
        if self.num_rows or (self.row_capacity <= INITIAL_SHAPE[0] and self.col_capacity <= INITIAL_SHAPE[1]):
            return False
        self.keys, self.values = [], []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.width = 0
        self._allocate(*INITIAL_SHAPE)
        return True

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (allocated, used or not)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.mask))

    @torch.inference_mode()
    def release(self) -> None:
        """Give every buffer back (colocation: the trainer needs the memory); ``reallocate`` takes it back."""
        self.keys, self.values = [], []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.num_rows = self.width = 0

    @torch.inference_mode()
    def reallocate(self) -> None:
        """The buffers of ``INITIAL_SHAPE`` again, after ``release``."""
        if not self.keys:
            self._allocate(*INITIAL_SHAPE)

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

    def row_kv(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one row's first ``length`` valid keys and values per layer ([heads, length, dim])."""
        columns = self.mask[row, : self.width].nonzero().squeeze(1)[:length]
        keys = [layer[row].index_select(1, columns) for layer in self.keys]
        values = [layer[row].index_select(1, columns) for layer in self.values]
        return keys, values

    def load_row(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Put the first ``length`` cached positions into columns ``0 .. length`` of ``row``."""
        for layer in range(self.num_layers):
            self.keys[layer][row, :, :length] = keys[layer][:, :length]
            self.values[layer][row, :, :length] = values[layer][:, :length]

    def view(self, rows: slice, start: int | torch.Tensor) -> _BufferView:
        """A transformers ``Cache`` writing the new keys of ``rows`` from column ``start``
        (one column for all rows, or a tensor with one start per row)."""
        return _BufferView(self, rows, start)


class _BufferView(Cache):
    """The ``Cache`` the model sees for one forward: writes in place, returns columns ``0 .. end``."""

    def __init__(self, buffer: KVBuffer, rows: slice, start: int | torch.Tensor):
        super().__init__(layers=[])
        self.buffer, self.rows, self.start = buffer, rows, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.buffer.keys[layer_idx], self.buffer.values[layer_idx]
        length = key_states.shape[-2]
        if isinstance(self.start, int):
            end = self.start + length
            keys[self.rows, :, self.start : end] = key_states
            values[self.rows, :, self.start : end] = value_states
        else:  # per-row starts: scatter [rows, heads, q, dim] into each row's own columns
            end = int(self.start.max()) + length
            row_index = torch.arange(self.rows.start, self.rows.stop, device=keys.device)[:, None]
            col_index = self.start[:, None] + torch.arange(length, device=keys.device)[None, :]
            keys[row_index, :, col_index] = key_states.transpose(1, 2)
            values[row_index, :, col_index] = value_states.transpose(1, 2)
        return keys[self.rows, :, :end], values[self.rows, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start if isinstance(self.start, int) else int(self.start.max())

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


@dataclass
class _Entry:
    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hashes: list[int]
    nbytes: int


class PrefixCache:
    """KV of finished sequences, reused by later prompts that start with the same tokens.

    The next turn of a conversation starts with the whole previous turn, and the prompts of
    a rollout share their system prompt, so most of a prompt is usually cached. Matching is
    by hash chains over blocks of ``block`` tokens (verified token by token); eviction is
    least-recently-used within ``max_bytes``. The cache must be cleared when weights change.
    """

    def __init__(self, max_bytes: int, block: int = 32):
        self.max_bytes, self.block = max_bytes, block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, int] = {}  # block-chain hash -> entry id
        self._next_id = 0
        self.nbytes = 0

    def _chain(self, tokens: list[int]) -> list[int]:
        hashes, h, block = [], 0, self.block
        for start in range(0, len(tokens) - block + 1, block):
            h = hash((h, *tokens[start : start + block]))
            hashes.append(h)
        return hashes

    def lookup(self, prompt: list[int]) -> tuple[_Entry | None, int]:
        """The entry holding the longest cached block-aligned prefix of ``prompt`` (leaving at
        least one token to compute) and that prefix's length."""
        found, length = None, 0
        for i, h in enumerate(self._chain(prompt[:-1])):
            entry_id = self._index.get(h)
            if entry_id is None:
                break
            end = (i + 1) * self.block
            entry = self._entries[entry_id]
            if entry.tokens[:end] != prompt[:end]:
                break
            found, length = entry_id, end
        if found is None:
            return None, 0
        self._entries.move_to_end(found)
        return self._entries[found], length

    def insert(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if len(tokens) < self.block or nbytes > self.max_bytes:
            return
        hashes = self._chain(tokens)
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = _Entry(tokens, keys, values, hashes, nbytes)
        for h in hashes:
            self._index[h] = entry_id
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._evict(next(iter(self._entries)))

    def _evict(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.nbytes -= entry.nbytes
        for h in entry.hashes:
            if self._index.get(h) == entry_id:
                del self._index[h]

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)
