"""The KV cache of the rows being decoded, in a layout a Hugging Face model attends over as is.

Per layer, keys and values live in one buffer ``[row_capacity, kv_heads, col_capacity,
head_dim]``. Live rows are ``0 .. rows-1``. Every row writes its next token at the same
column, ``cols`` (the decode column), so a decode step is one ``[rows, 1]`` forward with
no re-padding; the buffer is preallocated, so a step copies no old keys either (Hugging
Face's ``DynamicCache`` concatenates, i.e. copies the whole cache, every step). A row's
tokens sit at increasing columns, left-padded, with holes where a batched prefill padded
its prompt; ``valid`` marks the columns that hold a token, and positions are explicit per
row, so the column a token sits in never changes what the model computes.

A hybrid model's linear-attention layers keep no KV: their per-row state lives in
``RecurrentStates`` (``recurrent.py``), which the batch moves with its rows.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from post_training_cookbook.engine.recurrent import (
    LINEAR_ATTENTION,
    RecurrentStates,
    RowState,
    StateLayer,
)

ATTENTION_NAME = "post_training_cookbook_engine"


def engine_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Decode attention (one query per row) that groups query heads instead of copying KV heads.

    HF's SDPA path repeats the KV heads (a copy of the whole cache) whenever a mask is given,
    and CPU SDPA in bf16 is slow for one query; prefill and unusual attention go to SDPA
    (docs/performance.md: on par in fp32, several times faster in bf16).
    """
    unusual = any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sliding_window"))
    if query.shape[2] != 1 or attention_mask is None or unusual:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    rows, heads, _, dim = query.shape
    grouped = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    scale = scaling if scaling is not None else dim**-0.5
    out = grouped_attention(grouped, key, value, attention_mask, scale)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row, ``[rows, kv_heads, group, dim]``, over ``[rows, kv_heads, keys, dim]``
    keys and values with an additive ``bias`` broadcast to ``[rows, 1, 1, keys]``; softmax in
    float32."""
    if key.dtype != torch.float32:
        # CPU bf16 matmul takes a slow path on a strided window; a contiguous copy is cheaper.
        key, value = key.contiguous(), value.contiguous()
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale + bias
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


AttentionInterface.register(ATTENTION_NAME, engine_attention)


def _capacity(current: int, needed: int, minimum: int) -> int:
    """Keep the capacity while it fits, else the next power of two (amortised growth)."""
    if needed <= current:
        return current
    return max(minimum, 1 << (needed - 1).bit_length())


COLUMN_STEP = 256


def _col_capacity(current: int, needed: int) -> int:
    """Keep the capacity while it fits, else ``needed`` (headroom included) rounded up to a
    multiple of ``COLUMN_STEP``: every live row holds ``col_capacity`` columns of KV, so a power
    of two would hold up to twice the longest conversation's KV in every row (a 0.5B model's
    16 rows of 16,385 columns in fp32: 12.9 GB at 32,768, 8.1 GB at 20,736)."""
    if needed <= current:
        return current
    return max(64, -(-needed // COLUMN_STEP) * COLUMN_STEP)


class KVBatch:
    """Keys, values, valid columns, positions and next input token of the live rows (and,
    for a hybrid model, their recurrent states)."""

    def __init__(
        self,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
        states: RecurrentStates | None = None,
    ) -> None:
        self.dtype, self.device = dtype, device
        # Allocated on first write, when the model shows its KV head count and head size.
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.states = states
        """Linear-attention layers' per-row state; their slots in keys/values stay None."""
        linear = set(states.layers) if states is not None else set()
        self.kv_layers = [layer for layer in range(num_layers) if layer not in linear]
        self.rows = 0
        self.cols = 0
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(0, dtype=torch.long, device=device)  # next position id
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=device)  # next input id

    @property
    def row_capacity(self) -> int:
        return self.valid.shape[0]

    @property
    def col_capacity(self) -> int:
        return self.valid.shape[1]

    def first_col(self, rows: slice) -> int:
        """The first column any of ``rows`` uses: attention need not look further left."""
        used = self.valid[rows, : self.cols].any(0)
        return int(used.int().argmax()) if bool(used.any()) else self.cols

    def reserve(self, new_rows: int, left_cols: int) -> None:
        """Make room for ``new_rows`` rows, ``left_cols`` columns left of the decode column, and
        one decode column; drops dead columns on the left when it has to move data anyway."""
        rows_fit = self.rows + new_rows <= self.row_capacity
        if rows_fit and left_cols <= self.cols and self.cols < self.col_capacity:
            return
        start = self.first_col(slice(0, self.rows))
        used = self.cols - start
        cols = max(used, left_cols)
        if rows_fit and self.rows == 0 and cols < self.col_capacity:
            self.cols = cols  # nothing live to move: reuse the buffers
            return
        # A quarter of headroom, so that compaction does not repeat every step.
        col_capacity = _col_capacity(self.col_capacity, cols + 1 + cols // 4)
        row_capacity = _capacity(self.row_capacity, self.rows + new_rows, minimum=4)
        self._relayout(row_capacity, col_capacity, start, offset=cols - used)

    def _relayout(self, row_capacity: int, col_capacity: int, start: int, offset: int) -> None:
        """Copy live columns ``[start, cols)`` to ``[offset, ...)`` of fresh buffers."""
        used, rows = self.cols - start, self.rows
        new = slice(offset, offset + used)
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                if old is not None:
                    # zeros, not empty: a masked slot has weight 0, and 0 * NaN would still be NaN.
                    buffer = old.new_zeros(row_capacity, old.shape[1], col_capacity, old.shape[3])
                    buffer[:rows, :, new] = old[:rows, :, start : self.cols]
                    store[layer] = buffer
        valid = torch.zeros(row_capacity, col_capacity, dtype=torch.bool, device=self.device)
        valid[:rows, new] = self.valid[:rows, start : self.cols]
        self.valid = valid
        self.positions = _resized(self.positions, row_capacity, rows)
        self.next_tokens = _resized(self.next_tokens, row_capacity, rows)
        if self.states is not None:
            self.states.resize(row_capacity, rows)
        self.cols = offset + used

    def add_rows(self, count: int) -> int:
        """Append ``count`` empty rows (capacity must be reserved); returns the first index."""
        first = self.rows
        self.rows += count
        self.valid[first : self.rows] = False
        if self.states is not None:
            self.states.clear_rows(slice(first, self.rows))
        return first

    def remove_rows(self, dead: list[int]) -> list[tuple[int, int]]:
        """Drop ``dead`` rows by moving the last live rows into their slots; returns the moves."""
        dead_set = set(dead)
        keep = self.rows - len(dead_set)
        holes = [row for row in sorted(dead_set) if row < keep]
        movers = [row for row in range(keep, self.rows) if row not in dead_set]
        if holes:
            self.copy_rows(movers, holes)
        self.valid[keep : self.rows] = False
        self.rows = keep
        if keep == 0:
            self.cols = 0  # nothing live: start a fresh layout in the same buffers
        return list(zip(movers, holes, strict=True))

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        lo = self.first_col(slice(0, self.rows))
        for store in (self.keys, self.values):
            for buffer in store:
                if buffer is not None:
                    buffer[targets, :, lo : self.cols] = buffer[sources, :, lo : self.cols]
        self.valid[targets] = self.valid[sources]
        self.positions[targets] = self.positions[sources]
        self.next_tokens[targets] = self.next_tokens[sources]
        if self.states is not None:
            self.states.copy_rows(sources, targets)

    def write(
        self, layer: int, rows: slice, cols: slice, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        if self.keys[layer] is None:
            shape = (self.row_capacity, keys.shape[1], self.col_capacity, keys.shape[3])
            self.keys[layer] = keys.new_zeros(shape)
            self.values[layer] = values.new_zeros(shape)
        self._buffer(self.keys, layer)[rows, :, cols] = keys
        self._buffer(self.values, layer)[rows, :, cols] = values

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole key and value buffers, ``[row_capacity, kv_heads, cols, dim]``."""
        return self._buffer(self.keys, layer), self._buffer(self.values, layer)

    def window(
        self, layer: int, rows: slice, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._buffer(self.keys, layer)[rows, :, lo:hi]
        return keys, self._buffer(self.values, layer)[rows, :, lo:hi]

    def write_prefix(
        self,
        row: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        end: int,
        state: RowState | None = None,
    ) -> None:
        """Put cached ``[kv_heads, length, head_dim]`` KV (one per ``kv_layers`` entry) in the
        columns before end, and a hybrid model's recurrent ``state`` after those tokens."""
        length = keys[0].shape[1]
        cols = slice(end - length, end)
        for layer, k, v in zip(self.kv_layers, keys, values, strict=True):
            self.write(layer, slice(row, row + 1), cols, k[None], v[None])
        self.valid[row, cols] = True
        if state is not None:
            assert self.states is not None
            self.states.write_row(row, state)

    def row_kv(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A copy of one row's KV, valid columns only: ``[kv_heads, tokens, head_dim]`` for
        each of ``kv_layers``."""
        columns = self.valid[row, : self.cols].nonzero().squeeze(1)
        if len(columns) == 0:
            lo = hi = 0
        else:
            lo, hi = int(columns[0]), int(columns[-1]) + 1
        buffers = [
            self._buffer(store, i)[row]
            for store in (self.keys, self.values)
            for i in self.kv_layers
        ]
        if hi - lo == len(columns):  # the usual layout: one run of valid columns, copied whole
            copies = [b[:, lo:hi].clone(memory_format=torch.contiguous_format) for b in buffers]
        else:
            copies = [b.index_select(1, columns) for b in buffers]
        half = len(self.kv_layers)
        return copies[:half], copies[half:]

    def row_state(self, row: int) -> RowState | None:
        """A copy of one row's recurrent state (None for a model without linear attention)."""
        return self.states.row_state(row) if self.states is not None else None

    def attention_bias(self, rows: slice, lo: int, hi: int, queries: int) -> torch.Tensor:
        """Additive mask ``[rows, 1, queries, hi - lo]``: 0 where a query may look, min elsewhere.

        The queries sit in columns ``[hi - queries, hi)``; a key is visible when its column is
        valid and not to the right of the query (columns grow with positions within a row).
        """
        allowed = self.valid[rows, lo:hi][:, None, None, :]
        if queries > 1:
            key_cols = torch.arange(lo, hi, device=self.device)
            query_cols = torch.arange(hi - queries, hi, device=self.device)
            allowed = allowed & (key_cols[None, :] <= query_cols[:, None])
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return bias.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    @staticmethod
    def _buffer(store: list[torch.Tensor | None], layer: int) -> torch.Tensor:
        buffer = store[layer]
        if buffer is None:
            raise RuntimeError(f"layer {layer} has no KV yet; the model skipped the cache")
        return buffer


def _resized(tensor: torch.Tensor, capacity: int, keep: int) -> torch.Tensor:
    out = tensor.new_zeros(capacity)
    out[:keep] = tensor[:keep]
    return out


class WindowCache(Cache):
    """``past_key_values`` for one forward: rows ``rows`` of a KVBatch, columns ``[lo, hi)``,
    the new tokens being written to the last columns of that window; a linear-attention
    layer reads and writes those rows' recurrent states instead."""

    def __init__(self, batch: KVBatch, kinds: list[str]) -> None:
        layers: list[Any] = [
            StateLayer(self, i) if kind == LINEAR_ATTENTION else _WindowLayer(self, i)
            for i, kind in enumerate(kinds)
        ]
        super().__init__(layers=layers)
        self.batch = batch
        self.rows, self.lo, self.hi, self.past = slice(0, 0), 0, 0, 0

    def set_window(self, rows: slice, lo: int, hi: int, queries: int) -> None:
        self.rows, self.lo, self.hi, self.past = rows, lo, hi, hi - queries - lo

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past  # layer 0 of a hybrid model holds no KV to count


class _WindowLayer(DynamicLayer):
    def __init__(self, owner: WindowCache, index: int) -> None:
        super().__init__()
        # A weak reference: with a strong one the cache and its layers form a cycle, and a
        # dropped cache (the decoder's reset or release_memory) would keep its KVBatch's
        # buffers until Python's cyclic collector happened to run.
        self._owner = weakref.ref(owner)
        self.index = index
        self.is_initialized = True

    @property
    def owner(self) -> WindowCache:
        owner = self._owner()
        assert owner is not None, "a window layer outlived its cache"
        return owner

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner
        new_cols = slice(owner.hi - key_states.shape[2], owner.hi)
        owner.batch.write(self.index, owner.rows, new_cols, key_states, value_states)
        return owner.batch.window(self.index, owner.rows, owner.lo, owner.hi)

    def get_seq_length(self) -> int:
        return self.owner.past
