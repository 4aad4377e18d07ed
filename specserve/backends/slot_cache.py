"""A transformers ``Cache`` whose rows each keep their own length: batched speculative steps.

``DynamicCache`` and ``StaticCache`` write one position for the whole batch, but after a
verification every sequence has accepted a different number of tokens. Here each live
sequence owns a row of a preallocated ``[rows, heads, capacity, head_dim]`` pool; a forward
scatters the new keys/values at per-row slots and attends through a 4-D mask the backend
builds (causal by slot, or a branch tree in scratch slots past the committed length). Rolling back is moving a length
(stale slots are overwritten later), never copying. Knows nothing of drafting.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, pool: "SlotKVCache"):
        super().__init__()
        self.pool = pool

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        _, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        self.keys = key_states.new_zeros(self.pool.num_rows, heads, self.pool.capacity, key_dim)
        self.values = value_states.new_zeros(self.pool.num_rows, heads, self.pool.capacity, value_dim)
        self.is_initialized = True

    def grow(self, num_rows: int, capacity: int) -> None:
        if not self.is_initialized:
            return
        old_rows, heads, old_cap, key_dim = self.keys.shape
        if num_rows <= old_rows and capacity <= old_cap:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(max(num_rows, old_rows), heads, max(capacity, old_cap), old.shape[-1])
            new[:old_rows, :, :old_cap] = old
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states: [batch_size, heads, width, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, slots = self.pool.rows, self.pool.slots  # [batch_size], [batch_size, width]
        self.keys[rows[:, None], :, slots] = key_states.transpose(1, 2)
        self.values[rows[:, None], :, slots] = value_states.transpose(1, 2)
        kv_len = self.pool.kv_len
        if self.pool.contiguous is not None:
            start, stop = self.pool.contiguous
            return self.keys[start:stop, :, :kv_len], self.values[start:stop, :, :kv_len]
        return self.keys[rows, :, :kv_len], self.values[rows, :, :kv_len]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized and length > 0:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pool.kv_len, 0

    def get_seq_length(self) -> int:
        return self.pool.kv_len

    def get_max_length(self) -> int:
        return self.pool.capacity


class SlotKVCache(Cache):
    """Row pool shared by all layers; ``prepare`` sets where the next forward writes."""

    def __init__(self, num_rows: int = 8, capacity: int = 256):
        super().__init__(layer_class_to_replicate=functools.partial(_SlotLayer, self))
        self.num_rows = num_rows
        self.capacity = capacity
        self.rows: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.kv_len = 0
        self.contiguous: tuple[int, int] | None = None

    def ensure(self, num_rows: int, capacity: int) -> None:
        """Grow the pool (amortised doubling) so rows < num_rows and slots < capacity fit."""
        if num_rows > self.num_rows or capacity > self.capacity:
            self.num_rows = max(num_rows, 2 * self.num_rows if num_rows > self.num_rows else self.num_rows)
            self.capacity = max(capacity, 2 * self.capacity if capacity > self.capacity else self.capacity)
            for layer in self.layers:
                layer.grow(self.num_rows, self.capacity)

    def prepare(
        self,
        rows: torch.Tensor,  # [batch_size] long: pool row of each sequence
        slots: torch.Tensor,  # [batch_size, width] long: slot each new token is written to
        row_list: list[int],  # rows, on the host
        max_slot: int,  # slots.max(), on the host
    ) -> int:  # kv_len: the attention window (slots 0..kv_len-1 of each row)
        """Set where the next forward writes; the caller builds the attention mask."""
        self.rows, self.slots = rows, slots
        self.kv_len = max_slot + 1
        self.ensure(max(row_list) + 1, self.kv_len)
        is_range = row_list == list(range(row_list[0], row_list[0] + len(row_list)))
        self.contiguous = (row_list[0], row_list[0] + len(row_list)) if is_range else None
        return self.kv_len

    def copy_row(self, src: int, dst: int, length: int) -> None:
        for layer in self.layers:
            layer.copy_row(src, dst, length)
