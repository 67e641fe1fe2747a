"""A KV cache that a tree pass can write into and a verifier can compact, row by row.

transformers' `DynamicCache` concatenates on every forward (copying the whole prefix each
round) and assumes one write position shared by all rows. Speculation needs neither: each
row (sequence) appends its tree's n entries at its own length, the verifier keeps the
accepted path, and the rest is dropped. So every layer here owns a growable buffer
[rows, kv_heads, capacity, head_dim]; `lengths[row]` says how much of it is committed.

Protocol of one pass: `begin_pass(widths)` reserves room; the model's attention layers call
`update()`, which writes row b's new entries at [lengths[b], lengths[b] + widths[b]) and
returns the buffer up to the longest row (holes are masked by the caller's 4D mask);
`commit(row, kept)` then keeps the listed pass offsets (root and accepted nodes, in order)
as the row's next committed entries. Only kept entries move: the committed prefix is never
copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _RowBufferLayer(CacheLayerMixin):
    """One layer's keys and values for every row, in a buffer that doubles when full."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: TreeKVCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads, _, head_dim = key_states.shape
        shape = (rows, heads, self._owner.capacity, head_dim)
        self.keys = key_states.new_zeros(shape)  # [rows, kv_heads, capacity, head_dim]
        self.values = value_states.new_zeros(shape)
        self.is_initialized = True

    def _grow_to(self, capacity: int) -> None:
        if self.keys is None or capacity <= self.keys.shape[2]:
            return
        rows, heads, used, head_dim = self.keys.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((rows, heads, capacity, head_dim))
            new[:, :, :used] = old
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's entries (key_states: [rows, kv_heads, n, head_dim]) per row."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._grow_to(self._owner.capacity)
        for row, (start, width) in enumerate(zip(self._owner.lengths, self._owner.widths)):
            self.keys[row, :, start : start + width] = key_states[row, :, :width]
            self.values[row, :, start : start + width] = value_states[row, :, :width]
        end = self._owner.pass_end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def keep(self, row: int, start: int, kept: Sequence[int]) -> None:
        """Move pass entries `start + kept` of `row` to [start, start + len(kept))."""
        if self.keys is None:
            return
        source = torch.tensor(kept, dtype=torch.long, device=self.keys.device) + start  # [m]
        target = slice(start, start + len(kept))
        self.keys[row, :, target] = self.keys[row, :, source]
        self.values[row, :, target] = self.values[row, :, source]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.pass_end, 0

    def get_seq_length(self) -> int:
        return max(self._owner.lengths, default=0)

    def get_max_length(self) -> int:
        return -1


class TreeKVCache(Cache):
    """Per-row committed lengths over growable per-layer buffers; see the module docstring."""

    def __init__(self, num_layers: int, rows: int = 1, initial_capacity: int = 256) -> None:
        self.lengths: list[int] = [0] * rows
        self.widths: list[int] = [0] * rows
        self.capacity = initial_capacity
        super().__init__(layers=[_RowBufferLayer(self) for _ in range(num_layers)])

    @property
    def pass_end(self) -> int:
        """Columns the current pass attends over: the longest row's length plus its width."""
        return max(length + width for length, width in zip(self.lengths, self.widths))

    def begin_pass(self, widths: Sequence[int]) -> None:
        """Reserve room for `widths[row]` new entries per row before a forward pass."""
        if len(widths) != len(self.lengths):
            raise ValueError(f"{len(widths)} widths for {len(self.lengths)} rows")
        self.widths = list(widths)
        while self.capacity < self.pass_end:
            self.capacity *= 2

    @torch.inference_mode()  # the buffers were made in inference mode by the forward pass
    def commit(self, row: int, kept: Sequence[int]) -> None:
        """Keep the pass entries at offsets `kept` (ascending) as the row's next entries."""
        start = self.lengths[row]
        if list(kept) != list(range(len(kept))):  # a prefix of the pass is already in place
            for layer in self.layers:
                layer.keep(row, start, kept)
        self.lengths[row] = start + len(kept)
        self.widths[row] = 0
