"""Attention for a flat pass: the tokens of every running row in one sequence, each row
attending to its own KV row.

One pass carries rows of very different widths: a prompt chunk of hundreds of tokens beside
decode rows of one token or a small tree. Padding every row to the widest would make the
linear layers (most of the compute) work on padding, so the runner feeds all rows' tokens as
ONE flat sequence [1, T]: the linear layers see exactly T rows. Only attention needs the
rows apart, and this module's function does that: registered with transformers as the
`ngrammys_ragged` attention implementation, it receives the flat queries and the per-row KV
buffers (`TreeKVCache.update` returns them as a view) plus a `PassLayout`, and runs
scaled-dot-product attention per row: one batched call over every row with D query slots each
(the rows at most D wide; the others get padding slots there), plus one call per wider row.
D is chosen per pass to minimize query slots plus calls: a batched call pads every row to D,
so one 5-node tree among 15 one-token rows must not make all 16 rows attend with 5 queries
(a second query slot for every row measured far dearer than a call of its own for the wide row;
docs/benchmarks.md).

Masks: row r's node i sees the row's committed cache [0, start_r) and its own ancestors in
the tree (itself included), nothing else — the same rule as a single sequence. A layer with a
sliding window W (Mistral's, Qwen2's windowed layers, Gemma's local ones: `layer_windows`)
sees of those only the keys whose position is above the query's minus W, as transformers'
`sliding_window_overlay` rules; the pass's layout for it is `PassLayout.for_window(W)` (the
whole KV stays cached: a window bounds what is read, not what is kept).

On the packed CPU path the rows of at most `kernel_width` tokens (decode rows) skip the
batched call: a kernel (`service/kernels/attention_kernel.py`) attends each of their tokens over its
own row's length, with no padding to the longest row; wider rows get a call of their own.

A row may bring only the newer part of a tree: nodes [0, cached) then already sit, uncommitted,
at [start, start + cached) from an earlier pass of the same row, and the new nodes see them as
ancestors. A draft model grows its trees that way, one depth a pass, without feeding a node
twice (`service/model_drafts/draft_rows.py`). A row that brings nothing this pass has width 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from service.kernels.attention_kernel import token_attention
from service.kernels.chunk_attention_kernel import LANES, chunk_attention
from service.model.tree import TokenTree

IMPLEMENTATION = "ngrammys_ragged"
# What a call of its own costs, in query slots of the batched call: about one on a CPU
# (measured); on a GPU a launch costs far more than a padded query (an estimate, not measured).
CALL_SLOTS = {"cpu": 1}
GPU_CALL_SLOTS = 16
CALL_COLUMNS = 256  # the context length those call costs stand for (the CPU's was measured there)


@dataclass(frozen=True)
class KernelQueries:
    """The flat tokens whose attention the packed CPU path's kernel computes, as the arrays it
    takes (int64): token i attends to columns [0, starts[i]) of KV row rows[i], then to
    columns[column_offsets[i]:column_offsets[i + 1]] (its tree ancestors and itself)."""

    tokens: np.ndarray  # [n]: flat token index
    rows: np.ndarray  # [n]
    starts: np.ndarray  # [n]: the row's committed length
    columns: np.ndarray  # [sum of path lengths]: ascending cache positions
    column_offsets: np.ndarray  # [n + 1]


@dataclass(frozen=True)
class ChunkQueries:
    """Prompt tokens the chunk kernel answers (`service/kernels/chunk_attention_kernel.py`), in
    blocks of up to LANES consecutive tokens of a row (int64 arrays, one entry a block): block i
    is counts[i] flat tokens from tokens[i], at positions firsts[i], firsts[i] + 1, ... of KV
    row rows[i]."""

    rows: np.ndarray
    tokens: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class PassLayout:
    """Where each of a pass's T flat tokens sits: its row, its cache position, its mask."""

    # [rows]: columns each row attends over (committed + its whole tree); rows: the KV rows the
    # pass reads, [0, rows) (a fixed-shape pass pads the running rows to a power of two)
    ends: list[int]
    widths: list[int]  # [rows]: tokens each row brings
    write_rows: torch.Tensor  # [T] long: the KV row of each flat token
    write_positions: torch.Tensor  # [T] long: its position in that row
    position_ids: torch.Tensor  # [1, T] long: RoPE positions (start + depth)
    pass_end: int  # columns the pass attends over: max(start + width)
    row_masks: dict[int, torch.Tensor]  # per separate row: [1, 1, width, start + width]
    batched_mask: torch.Tensor | None  # [rows, 1, D, pass_end], when a batched call runs
    query_index: torch.Tensor | None  # [rows, D] long: flat token of each padded query slot
    batched_tokens: torch.Tensor | None  # [n] long: the flat tokens the batched call answers
    batched_slots: torch.Tensor | None  # [n] long: their padded slots (row * D + i)
    separate_rows: list[int]  # rows wider than D: a call each
    # every row brings one token (plain decoding): flat token r is row r's query
    one_token_rows: bool
    kernel_queries: KernelQueries | None = None  # tokens the attention kernel answers
    chunk_queries: ChunkQueries | None = None  # prompt tokens the chunk kernel answers
    skips: list[int] | None = None  # per row: its first tokens, the chunk kernel's (None: none)
    # query heads per KV head folded into the query length (masks repeated so)
    query_groups: int = 1
    # the layouts of windowed layers, by window (`for_window`); windows the pass fits in share
    # this one
    windowed: dict[int, PassLayout] = field(default_factory=dict)
    window: int = 0  # a windowed layer's window, which its chunk kernel applies (0: none)

    def for_window(self, window: int | None) -> PassLayout:
        """The layout a layer of sliding window `window` (None: none) attends with."""
        return self.windowed.get(window, self) if window else self

    @property
    def rows(self) -> int:
        return len(self.ends)

    @property
    def offsets(self) -> list[int]:
        """Flat index of each row's first token."""
        out, total = [], 0
        for width in self.widths:
            out.append(total)
            total += width
        return out

    @property
    def attended(self) -> tuple[list[int], list[int]]:
        """Per row, the flat index of its first token that the per-row paths (kernel, batched
        or separate calls) answer, and how many they answer: the tokens after its skips."""
        skips = self.skips or [0] * len(self.widths)
        return (
            [offset + skip for offset, skip in zip(self.offsets, skips)],
            [width - skip for width, skip in zip(self.widths, skips)],
        )


def build_layout(
    trees: Sequence[TokenTree],
    starts: Sequence[int],
    device: torch.device,
    cached: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    kernel_width: int = 0,
    query_groups: int = 1,
    prompts: Sequence[int] | None = None,
    windows: Sequence[int] = (),
) -> PassLayout:
    """The layout of a pass in which row r brings the nodes of `trees[r]` from `cached[r]` on
    (default: all) on top of `starts[r]` committed entries. Masks are additive, in `dtype`
    (the queries'): 0 where a query attends, -inf elsewhere. Made once a pass, they spare every
    layer's attention call the conversion of a boolean mask (a large share of a one-query call's
    time on a CPU; the outputs are bit for bit the same). Rows of 1 to
    `kernel_width` tokens go to the attention kernel, the others then get a call each.

    `prompts[r]` (packed CPU path): row r's first nodes that are prompt tokens needing no
    logits, a chain; those the row brings go to the chunk kernel, which answers them the same
    whatever chunks the prompt is cut into, and the row's other nodes see them as cached.

    `query_groups` > 1 (query heads per KV head) makes the attention calls fold each KV head's
    query heads into the query length (see `_attend`), so every mask is repeated that often
    along its queries here, once a pass, not in every layer.

    `windows`: the sliding windows of the model's layers, each getting its own masks
    (`PassLayout.for_window`), and its window passed to the chunk kernel."""
    cached = cached or [0] * len(trees)
    widths = [tree.num_nodes - c for tree, c in zip(trees, cached)]
    # first node attended by row
    firsts = [max(c, p) for c, p in zip(cached, prompts)] if prompts else list(cached)
    attending = [tree.num_nodes - f for tree, f in zip(trees, firsts)]
    skips = [f - c for f, c in zip(firsts, cached)]
    kernel_rows = [row for row, w in enumerate(attending) if 0 < w <= kernel_width]
    ends = [s + tree.num_nodes for s, tree in zip(starts, trees)]
    # node i of a row at start + i, its RoPE position start + depth: array operations over all
    # rows (tensors a row, and a mask for every row, were several times slower for many rows)
    count, start = np.array(widths), np.array(starts)
    row_offsets = np.cumsum(count) - count
    # a token's index among its row's
    in_row = np.arange(count.sum()) - np.repeat(row_offsets, count)
    depths = np.fromiter(
        itertools.chain.from_iterable(tree.depths[c:] for tree, c in zip(trees, cached)), np.int64
    )
    pass_end = max(ends)
    chunks = any(skips)
    width = (
        0
        if kernel_rows or chunks
        else batched_width(attending, CALL_SLOTS.get(device.type, GPU_CALL_SLOTS), ends)
    )
    batched_mask = query_index = batched_tokens = batched_slots = None
    if width:
        batched_mask, query_index, batched_tokens, batched_slots = _batched(
            trees, starts, cached, widths, pass_end, width
        )
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    separate_rows = [row for row, w in enumerate(attending) if w > width and row not in kernel_rows]
    positions = np.repeat(start, count) + depths
    attended_offsets = row_offsets + skips

    def masks(window: int | None) -> dict:
        """The masks and kernel queries of a layer of sliding window `window` (None: none)."""
        return dict(
            row_masks={
                row: _additive(
                    _row_mask(trees[row], starts[row], firsts[row], window),
                    device,
                    dtype,
                    query_groups,
                )
                for row in separate_rows
            },
            batched_mask=None
            if batched_mask is None
            else _additive(
                _within_window(batched_mask, trees, starts, cached, widths, window),
                device,
                dtype,
                query_groups,
            ),
            kernel_queries=_kernel_queries(
                trees, starts, firsts, attended_offsets, kernel_rows, window
            )
            if kernel_rows
            else None,
        )

    layout = PassLayout(
        ends=ends,
        widths=widths,
        write_rows=torch.from_numpy(np.repeat(np.arange(len(widths)), count)).to(device),
        write_positions=torch.from_numpy(np.repeat(start + np.array(cached), count) + in_row).to(
            device
        ),
        position_ids=torch.from_numpy(positions)[None].to(device),
        pass_end=pass_end,
        **masks(None),
        query_index=to(query_index),
        batched_tokens=to(batched_tokens),
        batched_slots=to(batched_slots),
        separate_rows=separate_rows,
        one_token_rows=not kernel_rows and not chunks and all(w == 1 for w in widths),
        chunk_queries=_chunk_queries(starts, cached, skips, row_offsets) if chunks else None,
        skips=skips if chunks else None,
        query_groups=query_groups,
    )
    for window in set(windows):
        if window < int(positions.max(initial=0)) + 1:  # some query sees past it
            layout.windowed[window] = replace(layout, **masks(window), windowed={}, window=window)
    return layout


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: it attends to the whole context), as
    transformers' models apply them: a window switched off (`use_sliding_window: false`) is
    none; `layer_types` says which layers are windowed (Gemma's local ones, Qwen2's past
    `max_window_layers`); without it every layer is (Mistral's)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * layers
    return [window if "sliding" in str(kind) else None for kind in types]


def _key_positions(tree: TokenTree, start: int) -> np.ndarray:
    """[start + n]: the position of each column of a row: the committed cache's, then its tree
    nodes' (start + depth)."""
    return np.concatenate([np.arange(start), start + np.asarray(tree.depths, dtype=np.int64)])


def _chunk_queries(
    starts: Sequence[int], cached: Sequence[int], skips: Sequence[int], row_offsets: np.ndarray
) -> ChunkQueries:
    """Each row's first skips[row] tokens (flat from row_offsets[row], at start + cached on) in
    blocks of up to LANES."""
    blocks = [
        (row, offset + i, start + c + i, min(LANES, skip - i))
        for row, (start, c, skip, offset) in enumerate(
            zip(starts, cached, skips, row_offsets.tolist())
        )
        for i in range(0, skip, LANES)
    ]
    rows, tokens, firsts, counts = (np.array(column, dtype=np.int64) for column in zip(*blocks))
    return ChunkQueries(rows, tokens, firsts, counts)


def prompt_prefix(tree: TokenTree, logits_from: int) -> int:
    """How many of `tree`'s first nodes are prompt tokens that need no logits: the chain before
    `logits_from` (a prompt chunk, with a tree on top when it is the prompt's last)."""
    if not logits_from:  # a decode row (every pass, every row): no array work
        return 0
    depths = np.asarray(tree.depths[:logits_from])
    off_chain = np.flatnonzero(depths != np.arange(len(depths)))
    return int(off_chain[0]) if len(off_chain) else len(depths)


def _kernel_queries(
    trees: Sequence[TokenTree],
    starts: Sequence[int],
    firsts: Sequence[int],
    attended_offsets: np.ndarray,
    kernel_rows: Sequence[int],
    window: int | None = None,
) -> KernelQueries:
    """The kernel rows' nodes from firsts[row] on; attended_offsets[row]: the first one's flat
    index. With a sliding `window` each node's columns are all listed (none as a committed
    range), those within the window."""
    tokens, rows, row_starts, columns, counts = [], [], [], [], [0]
    for row in kernel_rows:
        tree, start = trees[row], starts[row]
        key_positions = _key_positions(tree, start)
        paths: list[list[int]] = []  # each node's ancestors and itself, root first
        for node, parent in enumerate(tree.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [start + node])
        for node in range(firsts[row], tree.num_nodes):
            tokens.append(attended_offsets[row] + node - firsts[row])
            rows.append(row)
            path = paths[node]
            if window is None:
                row_starts.append(start)
            else:
                lowest = int(key_positions[start + node]) - window  # positions above it are seen
                committed = list(range(max(0, lowest + 1), start))
                path = committed + [c for c in path if key_positions[c] > lowest]
                row_starts.append(0)
            columns.extend(path)
            counts.append(len(path))
    as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return KernelQueries(
        as_array(tokens),
        as_array(rows),
        as_array(row_starts),
        as_array(columns),
        np.cumsum(counts, dtype=np.int64),
    )


def _additive(
    mask: torch.Tensor, device: torch.device, dtype: torch.dtype, query_groups: int = 1
) -> torch.Tensor:
    """A boolean mask (True = attend) [b, 1, n, L] as the additive one attention takes, 0 or
    -inf, [b, 1, query_groups * n, L]: the same n rows once for each folded query head."""
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return additive.repeat(1, 1, query_groups, 1).to(device)


def batched_width(widths: Sequence[int], call_slots: int, ends: Sequence[int] | None = None) -> int:
    """The query slots per row of the batched call (0: none, every row a call of its own) that
    minimize the attention's work: the batched call's rows x D query slots, each over the pass's
    longest row, plus for each wider row its width over its own columns (`ends`; default: rows
    alike) and the call's fixed cost, `call_slots` slots over CALL_COLUMNS. Rows of unlike lengths
    make the batched call's padding dear: sixteen four-token trees at Spec-Bench prompts' lengths
    spent more in one padded call than in a call each (docs/benchmarks.md)."""
    ends = ends or [CALL_COLUMNS] * len(widths)
    longest = max(ends, default=CALL_COLUMNS)

    def work(d: int) -> int:
        own_calls = sum(
            w * end + call_slots * CALL_COLUMNS for w, end in zip(widths, ends) if w > d
        )
        return len(widths) * d * longest + own_calls

    return min([0, *sorted(set(widths))], key=work)


def _row_mask(
    tree: TokenTree, start: int, cached: int = 0, window: int | None = None
) -> torch.Tensor:
    """[1, 1, n - cached, start + n] bool: the whole committed cache, then the tree's
    ancestors, for the nodes the row brings; of those, with a sliding `window`, the columns
    whose position is within it."""
    n = tree.num_nodes
    mask = torch.ones(1, 1, n - cached, start + n, dtype=torch.bool)
    mask[0, 0, :, start:] = torch.from_numpy(tree.ancestor_mask()[cached:])
    if window is not None:
        keys = _key_positions(tree, start)
        queries = keys[start + cached :]
        mask &= torch.from_numpy(keys[None, :] > queries[:, None] - window)
    return mask


def _within_window(
    mask: torch.Tensor,
    trees: Sequence[TokenTree],
    starts: Sequence[int],
    cached: Sequence[int],
    widths: Sequence[int],
    window: int | None,
) -> torch.Tensor:
    """The batched call's mask [rows, 1, D, pass_end] (`_batched`) with, given a sliding
    `window`, each answered query slot's columns cut to those within it (padding slots keep
    theirs: their output is dropped)."""
    if window is None:
        return mask
    mask = mask.clone()
    width, pass_end = mask.shape[2], mask.shape[3]
    for row, tree in enumerate(trees):
        if not 0 < widths[row] <= width:
            continue
        keys = _key_positions(tree, starts[row])
        queries = keys[starts[row] + cached[row] :]
        seen = np.zeros((len(queries), pass_end), dtype=bool)
        seen[:, : len(keys)] = keys[None, :] > queries[:, None] - window
        mask[row, 0, : len(queries)] &= torch.from_numpy(seen)
    return mask


def _batched(
    trees: Sequence[TokenTree],
    starts: Sequence[int],
    cached: Sequence[int],
    widths: Sequence[int],
    pass_end: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One padded mask [rows, 1, width, pass_end] for all rows (rows wider than `width` get
    padding slots only), with the gather index of the query slots and the flat tokens/slots the
    call answers. Built in array operations: one-node trees (plain decoding) need no loop."""
    count, start = np.array(widths), np.array(starts)
    slot = np.arange(width)
    # [rows, D]: a token of a row in the call
    answered = (slot[None, :] < count[:, None]) & (count[:, None] <= width)
    # the committed cache
    mask = answered[:, :, None] & (np.arange(pass_end)[None, None, :] < start[:, None, None])
    # padding slots attend somewhere (their output is dropped); real ones see column 0 anyway
    mask[:, :, 0] = True
    in_call = [row for row, w in enumerate(widths) if 0 < w <= width]
    roots = [row for row in in_call if trees[row].num_nodes == 1]
    if roots:
        mask[roots, 0, start[roots]] = True  # a lone root sees itself
    for row in in_call:
        tree = trees[row]
        if tree.num_nodes > 1:
            mask[row, : widths[row], starts[row] : starts[row] + tree.num_nodes] = (
                tree.ancestor_mask()[cached[row] :]
            )
    # [rows, D]: the flat token of each slot
    flat = (np.cumsum(count) - count)[:, None] + slot[None, :]
    slots = np.arange(len(widths))[:, None] * width + slot[None, :]
    return (
        torch.from_numpy(mask)[:, None],
        torch.from_numpy(np.where(answered, flat, 0)),
        torch.from_numpy(flat[answered]),
        torch.from_numpy(slots[answered]),
    )


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [rows, kv_heads, pass_end, head_dim] (a pass) or [b, kv_heads, n, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    pass_layout: PassLayout | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Per-row attention of a flat pass; other calls (no layout) go to the model's own kind.
    `sliding_window` (transformers' windowed layers give theirs) restricts either to it;
    `softcap` (Gemma 2's `attn_logit_softcapping`) caps the scores of either (`_attend`, with
    the arithmetic of transformers' eager attention, the one kind of Gemma 2's that caps)."""
    window: Any = kwargs.get("sliding_window")
    softcap: Any = kwargs.get("softcap")
    if pass_layout is None:
        queries, keys = query.shape[2], key.shape[2]
        masked = 1 < queries < keys or (window and keys > window) or (softcap and queries > 1)
        if attention_mask is None and masked:
            attention_mask = _causal_after_cache(queries, keys, query.device, query.dtype, window)
        if softcap is not None:  # the model's own kind, eager, is not registered by name
            capped = _attend(query, key, value, attention_mask, scaling, 1, softcap)
            return capped.transpose(1, 2), None  # [b, n, heads, head_dim], as eager's
        fallback = getattr(module.config, "ngrammys_inner_attention", "sdpa")
        inner = ALL_ATTENTION_FUNCTIONS.get_interface(fallback, sdpa_attention_forward)
        return inner(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layout = pass_layout.for_window(window)
    if layout.one_token_rows:  # no gather or scatter: [rows, heads, 1, head_dim] is a view
        out = _attend(
            query[0].transpose(0, 1)[:, :, None],
            key,
            value,
            layout.batched_mask,
            scaling,
            layout.query_groups,
            softcap,
        )
        return out[None, :, :, 0], None  # [1, T, heads, head_dim]
    heads, head_dim = query.shape[1], query.shape[3]
    batched = None
    if layout.batched_mask is not None:
        assert layout.query_index is not None and layout.batched_tokens is not None
        padded = query[0][:, layout.query_index].transpose(0, 1)  # [rows, heads, D, head_dim]
        # [rows, heads, D, head_dim]
        out = _attend(
            padded, key, value, layout.batched_mask, scaling, layout.query_groups, softcap
        )
        # [n, heads, d]
        batched = out.transpose(1, 2).reshape(-1, heads, head_dim)[layout.batched_slots]
        if not layout.separate_rows:
            return batched[None], None  # every token answered, in flat order
    flat = query.new_empty(query.shape[2], heads, head_dim)  # [T, heads, head_dim]
    if batched is not None:
        flat[layout.batched_tokens] = batched
    attend_separate_rows(query, key, value, layout, scaling, flat, softcap)
    return flat[None], None  # [1, T, heads, head_dim]


def kernel_attention(
    query: torch.Tensor,  # [1, heads, T, head_dim], a view of a contiguous [T, heads, head_dim]
    buffers: tuple[torch.Tensor, torch.Tensor],  # the layer's whole key and value buffers
    layout: PassLayout,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """A layout's attention [1, T, heads, head_dim] on the packed CPU path: the chunk kernel for
    its prompt tokens, the attention kernel for its narrow rows' tokens, a call each for the
    wider rows; each caps its scores at `softcap` (None: uncapped)."""
    queries = query[0].transpose(0, 1)  # [T, heads, head_dim]
    flat = torch.empty_like(queries)
    keys, values = buffers
    attend_through_kernels(
        queries.numpy(),
        kernel_array(keys),
        kernel_array(values),
        layout,
        scaling,
        softcap,
        flat.numpy(),
    )
    attend_separate_rows(query, *buffers, layout, scaling, flat, softcap)
    return flat[None]


def attend_through_kernels(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    layout: PassLayout,
    scaling: float,
    softcap: float | None,
    out: np.ndarray,
) -> None:
    """The attention of the layout's tokens that the kernels answer, into out [T, heads,
    head_dim]: its prompt tokens' by the chunk kernel, its narrow rows' by the attention kernel
    (`attend_separate_rows` does the rest). queries [T, heads, head_dim]; keys, values: the
    layer's whole buffers as `kernel_array` gives them."""
    head_dim, group, half = (
        queries.shape[2],
        queries.shape[1] // keys.shape[1],
        keys.dtype == np.uint16,
    )
    if layout.chunk_queries is not None:
        chunk = layout.chunk_queries
        chunk_attention(head_dim, group, half, softcap or 0.0, layout.window)(
            queries,
            keys,
            values,
            chunk.rows,
            chunk.tokens,
            chunk.firsts,
            chunk.counts,
            np.float32(scaling),
            out,
        )
    if layout.kernel_queries is not None:
        narrow = layout.kernel_queries
        token_attention(head_dim, group, half, softcap or 0.0)(
            queries,
            keys,
            values,
            narrow.tokens,
            narrow.rows,
            narrow.starts,
            narrow.columns,
            narrow.column_offsets,
            np.float32(scaling),
            out,
        )


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the kernels take it: float16 as its uint16 bits (numba has no float16)."""
    array = tensor.numpy()
    return array.view(np.uint16) if tensor.dtype == torch.float16 else array


def attend_separate_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PassLayout,
    scaling: float | None,
    flat: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """Attention of each of the layout's separate rows, one call a row, into flat
    [T, heads, head_dim] (`key`, `value`: [rows, kv_heads, at least pass_end, head_dim])."""
    offsets, widths = layout.attended
    for row in layout.separate_rows:
        offset, width, end = offsets[row], widths[row], layout.ends[row]
        flat[offset : offset + width] = _attend(
            query[:, :, offset : offset + width],
            key[row : row + 1, :, :end],
            value[row : row + 1, :, :end],
            layout.row_masks[row],
            scaling,
            layout.query_groups,
            softcap,
        )[0].transpose(0, 1)  # [width, heads, head_dim]


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    query_groups: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """Masked attention [b, heads, n, head_dim] of `query` [b, heads, n, head_dim] over `key`
    and `value` [b, kv_heads, L, head_dim]. With `query_groups` > 1 the query heads that share
    a KV head (heads h*g .. h*g+g-1 share KV head h, as transformers' `repeat_kv` pairs them)
    attend as g*n queries of one head, nothing copied but the queries. Grouped heads with a
    mask have no fused kernel on a GPU (flash takes no mask) and ran on the far slower math
    backend there; on a CPU too the folded call is faster (docs/benchmarks.md, "Attention on
    the GPU"). `mask` must then hold its n rows g times (`build_layout` repeats them).
    Scores capped at `softcap` take `_capped_attention` (SDPA cannot cap)."""
    attend = F.scaled_dot_product_attention if softcap is None else _capped_attention(softcap)
    if query_groups == 1:
        return attend(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    b, heads, n, head_dim = query.shape
    folded = query.reshape(b, heads // query_groups, query_groups * n, head_dim)
    out = attend(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, n, head_dim)


def _capped_attention(softcap: float) -> Callable[..., torch.Tensor]:
    """SDPA's call with each score capped at `softcap` (cap * tanh(score / cap)) after the
    scaling and before the mask, in the order of transformers' eager Gemma 2 attention: scores
    in the queries' dtype, the softmax in float32, rounded back before the values' matmul."""

    def attend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        scale: float | None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        groups = query.shape[1] // key.shape[1]  # > 1 with `enable_gqa` only
        if groups > 1:
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        scores = torch.matmul(query, key.transpose(2, 3)) * (scale or query.shape[-1] ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        if attn_mask is not None:
            scores = scores + attn_mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, value)

    return attend


def _causal_after_cache(
    queries: int, keys: int, device: torch.device, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """The additive causal mask [1, 1, queries, keys] of `queries` new tokens after `keys -
    queries` cached ones (each seeing the last `window` positions only, given one).
    transformers builds no mask for an attention kind it does not know, and the inner kinds
    then take their missing mask as causal from the top-left corner: right for a whole
    sequence, wrong for several tokens on top of a cache (transformers' own `generate` with
    prompt lookup on a served model), and blind to windows."""
    seen = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    if window is not None:
        seen &= torch.ones_like(seen).triu(keys - queries - window + 1)
    return torch.zeros(1, 1, queries, keys, dtype=dtype, device=device).masked_fill_(
        ~seen, float("-inf")
    )


def use_ragged_attention(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `ragged_attention`, keeping its own kind as the
    fallback for calls that are not flat passes (e.g. the model-table computation)."""
    config = model.config  # type: ignore[attr-defined]
    if config._attn_implementation != IMPLEMENTATION:
        config.ngrammys_inner_attention = config._attn_implementation
        config._attn_implementation = IMPLEMENTATION


AttentionInterface.register(IMPLEMENTATION, ragged_attention)
