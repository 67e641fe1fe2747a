"""Passes of a few fixed shapes, replayed as CUDA graphs.

On a GPU a small model's pass is host work: the embedded 30-layer model launches some 25
operators a layer, and an eager pass costs about the same whatever its size, the device idle
most of that time. A CUDA graph records a pass's launches once and replays them in one call,
several times faster (docs/benchmarks.md, "CUDA graphs"), but it needs every tensor at a fixed
address and every shape fixed. So a pass whose rows each bring a whole
tree of at most `SLOT_WIDTHS[-1]` nodes is brought to a fixed shape (`FixedShape`):
- its T flat tokens (every row's nodes, as in an eager pass) padded to a power of two with
  copies of the first row's root (same token, position and cache entry: they write what the
  root writes), so the linear layers compute about the tokens brought, not the padding below;
- attention over R rows of D query slots each (D the first of `SLOT_WIDTHS` that holds the
  widest tree; a row's unused slots ask for its root), gathered from the flat tokens and
  scattered back, over the cache's whole capacity, the mask built on the device from each
  row's committed length and its nodes' parents (nothing as large as the mask copied);
- R the running rows rounded up to a power of two (the cache's buffers hold that many rows):
  a row past the running ones has one node, its query and cache entry at column 0 of its own
  unused buffer row, so 5 to 8 rows are one shape, not four — under a steady load, rows come and
  go with every request, and each new shape is a recording (the time of many replays);
- one graph per shape and set of cache buffers, captured at its first pass; a cache's buffers
  pass on to the model's next cache (`SpareBuffers`), so they move only when they grow.
Passes of other shapes (prompt chunks, trees wider than the slots, rows continuing a tree
begun in an earlier pass) run eagerly (`service/model/runner.py`).

Where there is nothing to capture (a CPU), the same fixed-shape pass runs eagerly: the tests
hold it to the eager path's logits there.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from service.model.attention import PassLayout
from service.model.decoder_pass import lean_hidden
from service.model.kv_cache import SpareBuffers, TreeKVCache, power_of_two
from service.model.tree import TokenTree

# (up to 128: a fixed-mode tree of k=8 drafts of w=8 tokens is 65 nodes)
SLOT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
# Graphs kept, the least recently replayed dropped first: each holds its launches (~750 for the
# embedded model) and shares one memory pool with the others.
MAX_GRAPHS = 256


@dataclass(frozen=True)
class FixedShape:
    """A pass's shape as recorded: R rows of D query slots (the running rows padded to a power
    of two), T flat tokens."""

    rows: int
    slots: int
    tokens: int

    @classmethod
    def of(cls, sizes: Sequence[int]) -> FixedShape | None:
        """The shape of a pass of trees of `sizes` nodes; None where it has none (a tree wider
        than the widest slots, or a row bringing nothing)."""
        if min(sizes) == 0 or max(sizes) > SLOT_WIDTHS[-1]:
            return None
        slots = next(width for width in SLOT_WIDTHS if max(sizes) <= width)
        total, rows = sum(sizes), power_of_two(len(sizes))
        # one-token rows: flat token r is row r's query, nothing to gather (the padding rows' tokens
        # are padding)
        return cls(rows, slots, rows if slots == 1 else power_of_two(total))

    @property
    def parts(self) -> list[int]:
        """Sizes of the int64 inputs, in order: ids, positions, write rows, write positions and
        query slots of the tokens; the rows' starts and node counts; each slot's token and its
        node's parent."""
        return [self.tokens] * 5 + [self.rows] * 2 + [self.rows * self.slots] * 2


@dataclass
class _StaticPass:
    """One shape on one set of cache buffers: its inputs on the device, and once captured its
    graph and output."""

    inputs: torch.Tensor  # int64 [sum(shape.parts)]
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # [T, hidden], graph-owned: read before the next replay


class StaticPasses:
    """The fixed-shape passes of one model, captured as CUDA graphs when `capture`. One per
    model (`for_model`): the engines of a benchmark, each with its own runner, replay the same
    graphs, as long as their caches' buffers lie where the graphs were recorded (a CUDA
    allocator hands a freed buffer's memory back to the next buffer of that size)."""

    def __init__(self, model: PreTrainedModel, capture: bool) -> None:
        self.model = model
        self.capture = capture
        self.query_groups: int = (
            model.config.num_attention_heads // model.config.num_key_value_heads
        )
        # (cache buffers, shape) -> pass, least recently used first
        self._passes: OrderedDict[tuple[tuple[int, ...], FixedShape], _StaticPass] = OrderedDict()
        self._buffers: tuple[int, ...] = ()  # the buffers of the last pass's cache
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # spent recording graphs so far: one-off costs, not a pass's price
        self.capture_seconds = 0.0
        # the buffers the graphs were recorded with, while no cache holds them
        self.spare = SpareBuffers()

    @classmethod
    def for_model(cls, model: PreTrainedModel, capture: bool) -> StaticPasses:
        """The model's fixed-shape passes (made at the first call; kept on the model itself,
        so they go with it)."""
        static = getattr(model, "_ngrammys_static_passes", None)
        if static is None or static.capture != capture:
            static = cls(model, capture)
            model._ngrammys_static_passes = static
        return static

    @property
    def shapes(self) -> list[FixedShape]:
        """The shapes run on the last pass's cache buffers, least recently used first."""
        return [shape for buffers, shape in self._passes if buffers == self._buffers]

    def hidden(
        self,
        cache: TreeKVCache,
        trees: Sequence[TokenTree],
        shape: FixedShape,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The final-norm hidden states [shape.tokens, hidden] of the pass that appends row r's
        whole tree to cache row r (flat, rows in order, then padding); None if the cache has no
        buffers yet (its first pass sizes them) or they hold fewer than the shape's rows.
        `token_ids`: the flat tokens on the device, in place of the trees' (a device round's
        drafts; copied into the inputs there, padding included)."""
        starts = cache.lengths
        cache.reserve(max(start + tree.num_nodes for start, tree in zip(starts, trees)))
        self._buffers = cache.buffer_identity()
        if not self._buffers or self._buffers[0] < shape.rows:
            return None
        key = (self._buffers, shape)
        static = self._passes.get(key)
        fresh = static is None
        if static is None:
            static = self._passes[key] = _StaticPass(
                torch.zeros(sum(shape.parts), dtype=torch.long, device=self.model.device)
            )
        self._passes.move_to_end(key)
        inputs = torch.from_numpy(_inputs(trees, starts, shape))
        # from pinned memory the copy is queued, the host not made to wait
        on_gpu = static.inputs.device.type == "cuda"
        static.inputs.copy_(inputs.pin_memory() if on_gpu else inputs, non_blocking=on_gpu)
        if token_ids is not None:
            ids = static.inputs[: shape.tokens]
            ids[: len(token_ids)] = token_ids
            # padding: copies of the first row's root, as `_inputs` writes them
            ids[len(token_ids) :] = token_ids[0]
        if fresh and self.capture:
            began = time.perf_counter()
            self._record(cache, static, shape)
            self.capture_seconds += time.perf_counter() - began
        while (
            len(self._passes) > MAX_GRAPHS
        ):  # after recording: a memory pool dies with its last graph
            self._passes.popitem(last=False)
        if not self.capture:
            return self._run(cache, static.inputs, shape)
        assert static.graph is not None and static.hidden is not None
        static.graph.replay()
        return static.hidden

    def _record(self, cache: TreeKVCache, static: _StaticPass, shape: FixedShape) -> None:
        """Capture the pass on its current inputs: one run on a side stream first (capturing
        wants a warmed-up run; it writes what the replay then writes again), then the recording."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(cache, static.inputs, shape)
        torch.cuda.current_stream().wait_stream(side)
        static.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(static.graph, pool=self._pool):
            static.hidden = self._run(cache, static.inputs, shape)

    def _run(self, cache: TreeKVCache, inputs: torch.Tensor, shape: FixedShape) -> torch.Tensor:
        rows, slots, tokens = shape.rows, shape.slots, shape.tokens
        (
            ids,
            positions,
            write_rows,
            write_positions,
            token_slots,
            starts,
            sizes,
            query_index,
            parents,
        ) = inputs.split(shape.parts)
        layout = PassLayout(
            ends=[cache.capacity] * rows,
            widths=[slots] * rows,
            write_rows=write_rows,
            write_positions=write_positions,
            position_ids=positions[None],
            pass_end=cache.capacity,
            row_masks={},
            batched_mask=_tree_mask(
                starts,
                _ancestors(sizes, parents.view(rows, slots)),
                cache.capacity,
                self.model.dtype,
                self.query_groups,
            ),
            query_index=query_index.view(rows, slots),
            batched_tokens=torch.arange(tokens, device=inputs.device),
            batched_slots=token_slots,
            separate_rows=[],
            one_token_rows=slots == 1,
            query_groups=self.query_groups,
        )
        cache.begin_pass(layout)
        return lean_hidden(self.model, ids[None], layout, cache)


def _inputs(trees: Sequence[TokenTree], starts: Sequence[int], shape: FixedShape) -> np.ndarray:
    """The host side of a pass's inputs (`FixedShape.parts`)."""
    rows, slots, running = shape.rows, shape.slots, len(trees)
    # the padding rows (past the running ones): one node each, at column 0 of its own buffer row
    sizes, start = np.ones(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    sizes[:running], start[:running] = [tree.num_nodes for tree in trees], starts
    total = int(sizes[:running].sum())
    offsets = np.concatenate(
        [np.cumsum(sizes[:running]) - sizes[:running], np.zeros(rows - running, dtype=np.int64)]
    )
    out = np.empty(sum(shape.parts), dtype=np.int64)
    (
        ids,
        positions,
        write_rows,
        write_positions,
        token_slots,
        row_starts,
        row_sizes,
        query_index,
        parents,
    ) = np.split(out, np.cumsum(shape.parts)[:-1])
    row_of = np.repeat(np.arange(running), sizes[:running])
    in_row = np.arange(total) - offsets[row_of]
    ids[:total] = np.fromiter(
        itertools.chain.from_iterable(tree.token_ids for tree in trees), np.int64, total
    )
    positions[:total] = start[row_of] + np.fromiter(
        itertools.chain.from_iterable(tree.depths for tree in trees), np.int64, total
    )
    write_rows[:total] = row_of
    write_positions[:total] = start[row_of] + in_row
    token_slots[:total] = row_of * slots + in_row
    for part in (ids, positions, write_rows, write_positions, token_slots):
        part[total:] = part[0]  # padding: copies of the first row's root (answered as the root is)
    if slots == 1:  # but one-token rows' token r is row r's query: a padding row's token is its own
        write_rows[total:] = token_slots[total:] = np.arange(total, rows)
        # (an unused buffer row: what it holds past a row's length is never read)
        write_positions[total:] = 0
    row_starts[:], row_sizes[:] = start, sizes
    slot = np.arange(slots)
    query_index[:] = (offsets[:, None] + np.where(slot < sizes[:, None], slot, 0)).ravel()
    parents = parents.reshape(rows, slots)
    parents[:] = 0  # a root is its own parent; so are the slots past a row's tree
    for row in np.flatnonzero(sizes > 1):
        parents[row, 1 : sizes[row]] = trees[row].parents[1:]
    return out


def _ancestors(sizes: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[R, D, D] bool: slot j is slot i's node or one of its ancestors, in row r of `sizes[r]`
    nodes whose node i has parent `parents[r, i]` (slots past the nodes see the root alone).
    Paths of up to D nodes by squaring "itself or its parent" log2(D) times, on the device: the
    host sends a parent a node, not a [D, D] matrix (2 MB at 64 rows of 64 slots)."""
    rows, slots = parents.shape
    reach = torch.eye(slots, device=parents.device).expand(rows, slots, slots).clone()
    reach.scatter_(2, parents[:, :, None], 1.0)
    for _ in range((slots - 1).bit_length()):
        reach = (reach @ reach).clamp_(max=1.0)
    slot = torch.arange(slots, device=parents.device)
    # [R, D]: a row's nodes (and its root for the slots past them)
    seen = (slot < sizes[:, None]) | (slot == 0)
    return (reach > 0) & seen[:, None, :]


def _tree_mask(
    starts: torch.Tensor,
    ancestors: torch.Tensor,
    columns: int,
    dtype: torch.dtype,
    query_groups: int,
) -> torch.Tensor:
    """The additive mask [R, 1, query_groups * D, columns] of a fixed-shape pass: slot i of row
    r sees the row's committed columns [0, starts[r]) and, from starts[r] on, the slots j with
    ancestors[r, i, j] (`ancestors`: [R, D, D] bool). Built on the device, inside the graph."""
    rows, slots, _ = ancestors.shape
    # [R, columns]: column - start
    offset = torch.arange(columns, device=starts.device)[None] - starts[:, None]
    in_tree = ancestors.gather(2, offset.clamp(0, slots - 1)[:, None].expand(rows, slots, columns))
    # [R, D, columns]
    seen = (offset < 0)[:, None] | (in_tree & ((offset >= 0) & (offset < slots))[:, None])
    additive = torch.zeros(seen.shape, dtype=dtype, device=starts.device).masked_fill_(
        ~seen, float("-inf")
    )
    return additive[:, None].repeat(1, 1, query_groups, 1)
