"""A KV cache with one row per running request, written by flat passes and compacted per row.

transformers' `DynamicCache` concatenates on every forward (copying the whole prefix each
round) and assumes one write position shared by all rows. Batched speculation needs neither:
each row (request) appends its tree's entries at its own length, the verifier keeps the
accepted path, and the rest is dropped. So every layer has a buffer
[rows, kv_heads, capacity, head_dim] — a view of one buffer of all layers, so entries that a
commit or a leaving row moves are moved in one call, not one a layer — and `lengths[row]`
says how much of a row is committed.

Rows come and go with requests: `add_row()` appends one, `remove_row(row)` moves the last row
into the freed slot (one row copied, once), so the running rows are always rows [0, num_rows)
and a pass reads them as a view, never a gathered copy. When the last row leaves, the buffers
are released: memory returns to the idle baseline after a burst — unless passes are recorded
as CUDA graphs, which hold the buffers' addresses: then the buffers pass on to the next cache
of the model (`SpareBuffers`) and grow by powers of two of rows, so they move (are allocated
anew) a few times in a server's life rather than with every new row and every idle moment.

Protocol of one pass (see `service/model/attention.py`): the runner sets `layout` (where each of the
pass's T flat tokens goes: row and position); the model's attention layers call `update()`,
which scatters the T new entries into their rows and returns the rows' buffers up to the
pass's end; `commit(row, kept)` then keeps the listed pass offsets (root and accepted nodes,
in order) as the row's next committed entries. Only kept entries move.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from service.model.attention import PassLayout

INITIAL_CAPACITY = 256


def power_of_two(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): how buffers that pass on grow in rows, and
    so how a fixed-shape pass pads its rows (`service/model/static_pass.py`)."""
    return 1 << max(n - 1, 0).bit_length()


class _RowBufferLayer(CacheLayerMixin):
    """One layer's keys and values for every row: views of the cache's buffers of all layers."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: TreeKVCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._owner.make_buffers(key_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter this pass's T entries (key_states: [1, kv_heads, T, head_dim]) into their
        rows."""

        def scatter(keys: torch.Tensor, values: torch.Tensor, layout: PassLayout) -> None:
            rows, positions = layout.write_rows, layout.write_positions  # [T] each
            keys[rows, :, positions] = key_states[0].transpose(0, 1)  # [T, kv_heads, head_dim]
            values[rows, :, positions] = value_states[0].transpose(0, 1)

        return self.write_with(key_states, scatter)

    def write_with(
        self, like: torch.Tensor, write: Callable[[torch.Tensor, torch.Tensor, PassLayout], None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` with the writing left to `write(keys, values, layout)`, which puts the
        pass's entries into the whole buffers [rows, kv_heads, capacity, head_dim] (a kernel
        that computes them in place); `like` [1, kv_heads, T, head_dim] only gives the entries'
        shape, dtype and device. Returns the layout's rows' keys and values up to the pass's end."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        self._owner.fit_buffers()
        assert self.keys is not None and self.values is not None
        layout = self._owner.layout
        assert layout is not None, "a pass needs a layout (ModelRunner.forward sets it)"
        write(self.keys, self.values, layout)
        end, rows = layout.pass_end, layout.rows
        return self.keys[:rows, :, :end], self.values[:rows, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.layout.pass_end if self._owner.layout else 0, 0

    def get_seq_length(self) -> int:
        return max(self._owner.lengths, default=0)

    def get_max_length(self) -> int:
        return -1


class SpareBuffers:
    """The KV buffers a cache gave up when its last row left, for the next cache of the same
    model to take up at the same addresses: passes recorded as CUDA graphs read and write the
    buffers they were recorded with (`service/model/static_pass.py`), so the next request, or the
    next engine a benchmark builds, replays them instead of recording anew. One set at most,
    held while no cache uses it: memory stays at its size while idle."""

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values of all layers

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers or ())

    def give(self, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Hold `buffers`, or the larger of them and those held already."""
        if self._buffers is None or buffers[0].numel() >= self._buffers[0].numel():
            self._buffers = buffers

    def take(self, rows: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers held, if they have `rows` rows of `capacity` columns; else None, and
        those held are freed (a cache about to allocate must not hold memory twice)."""
        buffers, self._buffers = self._buffers, None
        if buffers is None or buffers[0].shape[1] < rows or buffers[0].shape[3] < capacity:
            return None
        return buffers


class TreeKVCache(Cache):
    """Per-row committed lengths over growable buffers of all layers; see the module docstring.
    `spare`: where the buffers go when the last row leaves, and come from when a row arrives."""

    def __init__(
        self,
        num_layers: int,
        rows: int = 1,
        dtype: torch.dtype | None = None,
        spare: SpareBuffers | None = None,
    ) -> None:
        self.lengths: list[int] = [0] * rows
        self.dtype = dtype  # the buffers' (None: the first entries')
        self.spare = spare
        self.capacity = INITIAL_CAPACITY
        self.layout: PassLayout | None = None
        # keys and values of every layer, [layers, rows, kv_heads, capacity, head_dim] each
        # (None: not made)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(layers=[_RowBufferLayer(self) for _ in range(num_layers)])

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def buffer_rows(self, rows: int | None = None) -> int:
        """Rows the buffers are to hold for `rows` rows (default: those in use): each, to a
        power of two when they pass on (`spare`)."""
        rows = self.num_rows if rows is None else rows
        return power_of_two(rows) if self.spare is not None else rows

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers now (0 when no row is in use)."""
        return sum(buffer.nbytes for buffer in self._buffers or ())

    def add_row(self) -> int:
        """A new, empty row; returns its index."""
        self.lengths.append(0)
        return self.num_rows - 1

    @torch.inference_mode()
    def remove_row(self, row: int) -> int | None:
        """Free `row` by moving the last row into it; returns the moved row's old index
        (None if nothing moved). The last row leaving releases the buffers."""
        last = self.num_rows - 1
        moved = None
        if row != last:
            # a row added since the buffers last grew holds no entries (none to move)
            for buffer in (self._buffers or ()) if self.lengths[last] else ():
                buffer[:, row, :, : self.lengths[last]] = buffer[:, last, :, : self.lengths[last]]
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths.pop()
        if not self.lengths:
            self._release_buffers()
        return moved

    def make_buffers(self, like: torch.Tensor) -> None:
        """Make every layer's buffers at the first write (`like`: the entries [1, kv_heads, T,
        head_dim]), or take up the spare ones."""
        if self.take_spare():
            return
        _, heads, _, head_dim = like.shape
        shape = (len(self.layers), self.buffer_rows(), heads, self.capacity, head_dim)
        dtype = self.dtype or like.dtype
        self._attach((like.new_zeros(shape, dtype=dtype), like.new_zeros(shape, dtype=dtype)))

    def pass_buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's keys and values [layers, rows, kv_heads, capacity, head_dim] for the
        pass begun, made at its first write (`like`: as `make_buffers` takes it) and grown to
        fit: for a pass that writes and reads them itself (`service/model/packed_pass.py`)."""
        if self._buffers is None:
            self.make_buffers(like)
        self.fit_buffers()
        assert self._buffers is not None
        return self._buffers

    def fit_buffers(self) -> None:
        """Grow the buffers to the rows and capacity now (copying what is there): the keys,
        then the values, each old buffer freed once copied, so memory peaks at the old values
        and both new buffers, not at the old and new buffers whole."""
        assert self._buffers is not None
        _, rows, heads, capacity, head_dim = self._buffers[0].shape
        if rows >= self.num_rows and capacity >= self.capacity:
            return
        shape = (
            len(self.layers),
            max(rows, self.buffer_rows()),
            heads,
            max(capacity, self.capacity),
            head_dim,
        )
        old = list(self._buffers)
        self._attach(None)  # (the layers' views hold the old buffers too)
        grown = []
        while old:
            buffer = old.pop(0)
            grown.append(buffer.new_zeros(shape))
            grown[-1][:, :rows, :, :capacity] = buffer
            del buffer
        self._attach((grown[0], grown[1]))

    def _attach(self, buffers: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Hold `buffers` (None: none), each layer a view of its part."""
        self._buffers = buffers
        for index, layer in enumerate(self.layers):
            layer.keys, layer.values = (
                (None, None) if buffers is None else (buffers[0][index], buffers[1][index])
            )
            layer.is_initialized = buffers is not None

    def _release_buffers(self) -> None:
        """Let the buffers go (to `spare`, if any)."""
        if self.spare is not None and self._buffers is not None:
            self.spare.give(self._buffers)
        self._attach(None)
        self.capacity = INITIAL_CAPACITY

    def take_spare(self) -> bool:
        """Before the buffers are first made: take up the spare ones if they are large enough
        (then the capacity is theirs). Whether it did."""
        if self.spare is None or self._buffers is not None:
            return False
        buffers = self.spare.take(self.buffer_rows(), self.capacity)
        if buffers is None:
            return False
        self._attach(buffers)
        self.capacity = buffers[0].shape[3]
        return True

    @property
    def held_rows(self) -> int:
        """Rows the buffers hold now (0: none made)."""
        return 0 if self._buffers is None else self._buffers[0].shape[1]

    def begin_pass(self, layout: PassLayout) -> None:
        """Reserve room for the pass described by `layout`."""
        self.layout = layout
        self.reserve(layout.pass_end)

    def reserve(self, columns: int) -> None:
        """Make every row hold `columns` entries (doubling the capacity as needed; the buffers
        grow at their next write, or in `buffer_identity`)."""
        while self.capacity < columns:
            self.capacity *= 2

    @torch.inference_mode()
    def buffer_identity(self) -> tuple[int, ...]:
        """Where the buffers lie, and their rows and capacity, once grown to the rows and
        capacity now (empty before a first pass has made them): a pass recorded as a CUDA
        graph reads and writes the buffers it was recorded with (`service/model/static_pass.py`)."""
        self.take_spare()
        if self._buffers is None:
            return ()
        self.fit_buffers()
        _, rows, _, capacity, _ = self._buffers[0].shape
        return (rows, capacity, *(buffer.data_ptr() for buffer in self._buffers))

    @torch.inference_mode()
    def entries(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the row's committed entries [start, end): keys and values of every
        layer, [layers, kv_heads, end - start, head_dim] each (a prefix cache's block)."""
        assert self._buffers is not None and 0 <= start <= end <= self.lengths[row]
        keys, values = (
            buffer[:, row, :, start:end].clone(memory_format=torch.contiguous_format)
            for buffer in self._buffers
        )
        return keys, values

    @property
    def entry_nbytes(self) -> int:
        """Bytes of one entry: its keys and values in every layer (0 before the buffers exist)."""
        return sum(
            buffer[:, 0, :, 0].numel() * buffer.element_size() for buffer in self._buffers or ()
        )

    @torch.inference_mode()
    def append_entries(self, row: int, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Commit entries computed earlier (`entries` of some row) as the row's next ones."""
        if not blocks:
            return
        if self._buffers is None:
            # like one layer's [1, kv_heads, T, head_dim]
            self.make_buffers(blocks[0][0][0].unsqueeze(0))
        start = self.lengths[row]
        self.reserve(start + sum(keys.shape[2] for keys, _ in blocks))
        self.fit_buffers()
        assert self._buffers is not None
        for keys, values in blocks:
            end = start + keys.shape[2]
            self._buffers[0][:, row, :, start:end] = keys
            self._buffers[1][:, row, :, start:end] = values
            start = end
        self.lengths[row] = start

    @torch.inference_mode()
    def keep_paths(self, starts: torch.Tensor, paths: torch.Tensor, counts: torch.Tensor) -> None:
        """Rows [0, R)'s accepted paths moved into place on the device, all rows and layers in
        one gather and one scatter, before the host knows how long they are: row r's pass
        entry `paths[r, d]` (offset from `starts[r]`) goes to offset d for d in 1..counts[r]
        (the root's entry, offset 0, is in place); past counts[r] an entry is copied onto
        itself. `advance` then commits them, once the counts reach the host."""
        rows, depth = paths.shape[0], paths.shape[1] - 1
        if self._buffers is None or depth == 0:
            return
        offsets = torch.arange(1, depth + 1, device=paths.device)[None]  # [1, W]
        moving = offsets <= counts[:, None]
        targets = starts[:, None] + offsets
        sources = torch.where(moving, starts[:, None] + paths[:, 1:], targets)
        row_index = torch.arange(rows, device=paths.device)[:, None].expand(rows, depth)
        for buffer in self._buffers:  # all read before any is written
            buffer[:, row_index, :, targets] = buffer[:, row_index, :, sources]

    def advance(self, row: int, entries: int) -> None:
        """Commit the `entries` pass entries at the row's end that `keep_paths` put in place."""
        self.lengths[row] += entries

    def commit(self, row: int, kept: Sequence[int]) -> None:
        """Keep the pass entries at offsets `kept` (ascending) as the row's next entries."""
        self.commit_rows({row: kept})

    @torch.inference_mode()  # the buffers were made in inference mode by the forward pass
    def commit_rows(self, kept_by_row: Mapping[int, Sequence[int]]) -> None:
        """`commit` for several rows: the entries that move (those after the first kept one
        not already in place) move in one gather and one scatter of the keys and of the values,
        all layers and rows together. On a GPU each call is a launch: a call per layer took a
        tenth of a speculating step of one request, a call per row and layer would be thousands
        of launches a step at large batches (docs/benchmarks.md)."""
        moves = []
        for row, kept in kept_by_row.items():
            start = self.lengths[row]
            moves += [
                (row, start + offset, start + entry)
                for offset, entry in enumerate(kept)
                if entry != offset
            ]
            self.lengths[row] = start + len(kept)
        if moves and self._buffers is not None:
            rows, targets, sources = torch.tensor(moves, dtype=torch.long).T.to(
                self._buffers[0].device
            )
            for buffer in self._buffers:  # all read before any is written
                buffer[:, rows, :, targets] = buffer[:, rows, :, sources]
