"""Causal attention of prompt chunks on the packed CPU path, sixteen queries to a vector.

`attention_kernel.py` attends one token at a time: each score is a dot product summed across
the lanes of a vector, then the lanes are added by a tree of shuffles, most of a long prompt's
pass. Here a vector holds sixteen consecutive prompt tokens of one query head instead, so
every step is a lane-wise multiply-add with one key or value entry broadcast: no shuffles, a
key entry read once for all sixteen tokens and every query head of its KV head; eight columns'
scores are summed at once over all dims, so each is stored once. A (query head, column) pair
takes much less time so (docs/benchmarks.md, "Prompt tokens' own kernels").

Each query's arithmetic is fixed by the query alone, whatever its block holds or where the
chunk starts, so a prompt gets the same bits however it is cut into chunks:
- score_j = (fused multiply-adds from 0 over dims 0, 1, ... in order) × scale, capped as
  `VectorIR.soft_cap` caps it for a model with soft-capped scores (Gemma 2's);
- max over its columns j ≤ its position (and, in a layer of sliding window W, j > its position
  - W); p_j = exp(score_j - max) by `VectorIR.exp`;
- sum = Σ p_j in column order; out[c] = (Σ_j p_j·v_j[c] by fused multiply-adds in column
  order) / sum.
Columns past a query's position (the later tokens of its block), and in a windowed layer those
at or below its position - W, count as p = 0, which adds nothing to its sums: the columns a
block reads start at its first token's window, so where its block starts does not matter. A
float16 cache (the 8-bit path's) is widened to float32 first.

Only prompt tokens that need no logits come here (`service/model/attention.py`): a prompt's
last token and every tree node attend through `attention_kernel.py`, so a tree node's bits
equal the same token decoded alone, as speculation needs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from service.kernels.attention_kernel import VectorIR
from service.kernels.native import compile_ir

LANES = 16  # queries a vector: consecutive tokens of one query head
COLUMNS = 8  # columns whose scores are summed at once (group x COLUMNS accumulators)
DIMS = 8  # head dims a sweep over the columns carries per query head
HEADS = 2  # query heads a sweep carries: HEADS x DIMS accumulators (more spill registers)


def chunk_kernel_fits(head_dim: int) -> bool:
    """Whether the kernel takes heads of `head_dim` (a float16 row widens LANES entries at a
    time)."""
    return head_dim % LANES == 0


class _ChunkEmitter(VectorIR):
    """Builds `chunk(qt, keys, values, first, count, scale, out, scores)`: the attention of
    the `count` (≤ LANES) tokens at positions first, first + 1, ... of one KV head's `group`
    query heads. qt [group, head_dim, LANES] their queries (lane i: token i), keys and values
    [first + count, head_dim] float32, out [group, head_dim, LANES]; scores [group, first +
    count, LANES] is scratch. Scores capped at `softcap` (0: uncapped); a token sees the
    `window` columns up to its own (0: all)."""

    def __init__(self, head_dim: int, group: int, softcap: float = 0.0, window: int = 0) -> None:
        super().__init__(LANES, "ngrammys_chunk_attention")
        if not chunk_kernel_fits(head_dim):
            raise ValueError(
                f"the chunk attention kernel needs a head size divisible by {LANES}, not {head_dim}"
            )
        self.head_dim, self.group, self.softcap, self.window = head_dim, group, softcap, window
        f32p = self.f32.as_pointer()
        self.begin(
            "chunk", [f32p, f32p, f32p, self.i64, self.i64, self.ir.DoubleType(), f32p, f32p]
        )

    def entry(self, pointer: Any, j: Any, dim: int) -> Any:
        """Column j's entry `dim` of keys or values, in every lane."""
        b = self.b
        return self.splat(
            b.load(b.gep(pointer, [b.add(b.mul(j, self.const(self.head_dim)), self.const(dim))]))
        )

    def score_at(self, columns: Any, h: int, j: Any) -> Any:
        """Offset of head h's column j in the scores ([group, columns, LANES])."""
        b = self.b
        return b.mul(b.add(b.mul(self.const(h), columns), j), self.const(LANES))

    def build(self) -> str:
        ir, b = self.ir, self.b
        qt, keys, values, first, count, scale64, out, scores = self.function.args
        n = b.add(first, count)
        scale = self.splat(b.fptrunc(scale64, self.f32))
        lane = ir.Constant(ir.VectorType(self.i64, LANES), list(range(LANES)))
        group, sweeps = self.group, self.head_dim // DIMS
        blocks = b.udiv(b.add(n, self.const(COLUMNS - 1)), self.const(COLUMNS))
        padded = b.mul(blocks, self.const(COLUMNS))  # the scores' columns
        low = self.const(0)  # the first column any token of the block sees
        if self.window:
            bottom = b.sub(first, self.const(self.window - 1))
            low = b.select(b.icmp_signed(">", bottom, low), bottom, low)
        low_block = b.udiv(low, self.const(COLUMNS))

        def seen(j: Any) -> Any:  # lanes whose token sits at or after column j (within W)
            offset = self.splat(b.sub(j, first))
            at_or_after = b.icmp_signed(">=", lane, offset)
            if not self.window:
                return at_or_after
            within = b.icmp_signed("<", lane, b.add(offset, self.splat(self.const(self.window))))
            return b.and_(at_or_after, within)

        def from_low(body: Any) -> Any:  # a loop body over columns j = low + i
            return lambda i, carried: body(b.add(low, i), carried)

        def score_block(i: Any, _: list[Any]) -> list[Any]:  # COLUMNS columns, all dims
            first_column = b.mul(b.add(low_block, i), self.const(COLUMNS))
            last = b.sub(n, self.const(1))
            columns = []
            for c in range(COLUMNS):  # past n: the last column again (those scores are never read)
                column = b.add(first_column, self.const(c))
                columns.append(b.select(b.icmp_signed("<", column, n), column, last))

            def dim(d: Any, sums: list[Any]) -> list[Any]:
                q = [
                    self.load_vector(
                        qt,
                        b.mul(
                            b.add(b.mul(self.const(h), self.const(self.head_dim)), d),
                            self.const(LANES),
                        ),
                    )
                    for h in range(group)
                ]
                keys_d = [
                    self.splat(
                        b.load(b.gep(keys, [b.add(b.mul(column, self.const(self.head_dim)), d)]))
                    )
                    for column in columns
                ]
                return [
                    b.call(self.fma, [q[h], key, sums[c * group + h]])
                    for c, key in enumerate(keys_d)
                    for h in range(group)
                ]

            sums = self.loop(
                self.const(self.head_dim), "dims", [self.filled(0.0)] * (COLUMNS * group), dim
            )
            for c in range(COLUMNS):
                for h in range(group):
                    self.store_vector(
                        self.scaled(sums[c * group + h], scale, self.softcap),
                        scores,
                        self.score_at(padded, h, b.add(first_column, self.const(c))),
                    )
            return []

        self.loop(b.sub(blocks, low_block), "scores", [], score_block)
        columns = b.sub(n, low)

        def highest(j: Any, carried: list[Any]) -> list[Any]:
            return [
                self.maxnum_call(
                    top,
                    b.select(
                        seen(j),
                        self.load_vector(scores, self.score_at(padded, h, j)),
                        self.filled(float("-inf")),
                    ),
                )
                for h, top in enumerate(carried)
            ]

        tops = self.loop(columns, "max", [self.filled(float("-inf"))] * group, from_low(highest))

        def exponentials(j: Any, carried: list[Any]) -> list[Any]:
            sums = []
            for h, total in enumerate(carried):
                at = self.score_at(padded, h, j)
                p = b.select(
                    seen(j),
                    self.exp(b.fsub(self.load_vector(scores, at), tops[h])),
                    self.filled(0.0),
                )
                self.store_vector(p, scores, at)
                sums.append(b.fadd(total, p))
            return sums

        totals = self.loop(columns, "exp", [self.filled(0.0)] * group, from_low(exponentials))

        for heads in (
            range(h, min(group, h + HEADS)) for h in range(0, group, HEADS)
        ):  # out = Σ p_j v_j / sum
            for sweep in range(sweeps):  # DIMS dims of HEADS heads a sweep over the columns
                dims = range(sweep * DIMS, (sweep + 1) * DIMS)

                def weighted(
                    j: Any, carried: list[Any], dims: range = dims, heads: range = heads
                ) -> list[Any]:
                    entries = [self.entry(values, j, d) for d in dims]
                    updated = []
                    for i, h in enumerate(heads):
                        p = self.load_vector(scores, self.score_at(padded, h, j))
                        updated += [
                            b.call(self.fma, [p, entry, carried[i * DIMS + k]])
                            for k, entry in enumerate(entries)
                        ]
                    return updated

                sums = self.loop(
                    columns,
                    f"values{heads[0]}_{sweep}",
                    [self.filled(0.0)] * (len(heads) * DIMS),
                    from_low(weighted),
                )
                for i, h in enumerate(heads):
                    for k, d in enumerate(dims):
                        self.store_vector(
                            b.fdiv(sums[i * DIMS + k], totals[h]),
                            out,
                            self.const((h * self.head_dim + d) * LANES),
                        )
        b.ret_void()
        return str(self.module)


def _widen_ir() -> str:
    """`widen(source, target, count)`: `count` (a multiple of LANES) float16 values as float32."""
    emit = VectorIR(LANES, "ngrammys_widen")
    halves16 = emit.ir.VectorType(emit.ir.HalfType(), LANES)
    emit.begin("widen", [emit.ir.HalfType().as_pointer(), emit.f32.as_pointer(), emit.i64])
    source, target, count = emit.function.args
    b = emit.b

    def step(i: Any, _: list[Any]) -> list[Any]:
        at = b.mul(i, emit.const(LANES))
        halves = b.load(b.bitcast(b.gep(source, [at]), halves16.as_pointer()), align=2)
        emit.store_vector(b.fpext(halves, emit.vector), target, at)
        return []

    emit.loop(b.udiv(count, emit.const(LANES)), "widen", [], step)
    b.ret_void()
    return str(emit.module)


@functools.cache
def chunk_attention(
    head_dim: int, group: int, half: bool = False, softcap: float = 0.0, window: int = 0
) -> Any:
    """`chunk_attention(head_dim, group, half, softcap, window)(queries, keys, values, rows,
    tokens, firsts, counts, scale, out)`: causal attention of prompt blocks, scores capped at
    `softcap` (0: uncapped). Block i is counts[i] (≤ LANES) consecutive flat tokens from
    tokens[i], at positions firsts[i], firsts[i] + 1, ... of KV row rows[i]; each attends to
    that row's columns up to its own position (the last `window` of them; 0: all). queries [T,
    heads, head_dim]; keys, values [rows, kv_heads,
    capacity, head_dim] (float32, or with `half` float16 as uint16 bits); writes out[token]
    [heads, head_dim]. One task per (block, KV head) over numba's threads."""
    pointer = ctypes.c_int64
    kernel = compile_ir(
        _ChunkEmitter(head_dim, group, softcap, window).build(),
        "chunk",
        [
            pointer,
            pointer,
            pointer,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_double,
            pointer,
            pointer,
        ],
    )
    widen = compile_ir(_widen_ir(), "widen", [pointer, pointer, ctypes.c_int64])

    @njit(parallel=True, nogil=True)
    def attention(
        queries, keys, values, rows, tokens, firsts, counts, scale, out
    ):  # pragma: no cover - compiled
        kv_heads = keys.shape[1]
        tasks = rows.shape[0] * kv_heads
        parts = min(tasks, numba.get_num_threads())
        columns = 0
        for block in range(rows.shape[0]):
            columns = max(columns, firsts[block] + counts[block])
        padded = (columns + COLUMNS - 1) // COLUMNS * COLUMNS
        for part in prange(parts):  # scratch once a thread: fresh megabytes a task cost page faults
            qt = np.zeros((group, head_dim, LANES), np.float32)
            widened = np.empty((2, padded if half else 0, head_dim), np.float32)
            scores = np.empty(group * padded * LANES, np.float32)
            attended = np.empty((group, head_dim, LANES), np.float32)
            for task in range(
                part, tasks, parts
            ):  # interleaved: the blocks' costs grow along the prompt
                block, kv_head = task // kv_heads, task % kv_heads
                row, token, count = rows[block], tokens[block], counts[block]
                n = firsts[block] + count
                qt[:] = 0
                for h in range(group):
                    for i in range(count):
                        qt[h, :, i] = queries[token + i, kv_head * group + h]
                if half:  # the columns the block reads: from its first token's window on
                    low = max(0, firsts[block] - window + 1) if window else 0
                    size = (n - low) * head_dim
                    widen(keys[row, kv_head, low:].ctypes.data, widened[0, low:].ctypes.data, size)
                    widen(
                        values[row, kv_head, low:].ctypes.data, widened[1, low:].ctypes.data, size
                    )
                kernel(
                    qt.ctypes.data,
                    widened[0].ctypes.data if half else keys[row, kv_head].ctypes.data,
                    widened[1].ctypes.data if half else values[row, kv_head].ctypes.data,
                    firsts[block],
                    count,
                    np.float64(scale),
                    attended.ctypes.data,
                    scores.ctypes.data,
                )
                for i in range(count):
                    for h in range(group):
                        out[token + i, kv_head * group + h] = attended[h, :, i]

    return attention


def warm_up(
    head_dim: int, group: int, half: bool, softcap: float = 0.0, windows: Iterable[int] = ()
) -> None:
    """Build and compile the kernels for a model's heads (its cap, and its sliding windows
    beside none) now, not in the first prompt's pass."""
    index = np.zeros(1, np.int64)
    queries = np.zeros((1, group, head_dim), np.float32)
    cache = np.zeros((1, 1, 1, head_dim), np.uint16 if half else np.float32)
    for window in {0, *windows}:
        chunk_attention(head_dim, group, half, softcap, window)(
            queries,
            cache,
            cache,
            index,
            index,
            index,
            np.ones(1, np.int64),
            np.float32(1.0),
            np.empty_like(queries),
        )
