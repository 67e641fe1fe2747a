"""Attention of a pass's tokens on the packed CPU path, each token over its own KV row.

Every token attends on its own, to columns [0, start) of its row and then to its tree path
(its ancestors and itself; a prompt chunk's token: the chunk's tokens up to itself), with the
same arithmetic whatever else the pass holds: a tree node, the same token decoded alone and a
prompt token in a chunk of any width get the same bits, so speculation and chunked prefill
reproduce plain decoding exactly (on the 8-bit path every row attends here, see
`service/model/decoder_pass.py`).

The arithmetic, per (query head, token), over its n columns in order, `lanes` = 16 float32
lanes (8 or 4 when the head size is not a multiple of 16):
- score_j = scale * Σ_c q[c]·k_j[c]: lane l sums q·k over dims l, l + lanes, ... by fused
  multiply-adds in order, then the lanes are added pairwise in a fixed tree (l with
  l + lanes/2, then l + lanes/4, ...). Keys go `lanes` at a time through one transposing
  tree, so a block of scores costs `lanes - 1` vector additions instead of `lanes` horizontal
  sums; every key takes the same path through it, so its score does not depend on its block.
  A model with soft-capped scores (Gemma 2's) then caps each: cap * tanh(score / cap)
  (`VectorIR.soft_cap`).
- p_j = exp(score_j - max): a Cephes polynomial in vector lanes (within a few float32 ulps);
  the sum of the p_j in lanes (column j in lane j mod `lanes`, blocks in order) and then the
  same fixed tree.
- out[c] = (Σ_j p_j·v_j[c], fused multiply-adds in column order) / sum.

The cache may hold float16 (the 8-bit path's, as llama.cpp keeps it): entries are widened to
float32 as they are loaded, the arithmetic is the same. Sixteen decoding rows read every row's
keys and values once a layer, from memory, not from a cache: halving those bytes is what makes
that pass cheaper (docs/benchmarks.md).

numba's vectorizer cannot be told to keep a float order across loop shapes (a numba kernel
summed each score horizontally and kept the value sums in memory, and was slower:
docs/benchmarks.md, "The attention kernel and a float16 cache"), so the IR is built here
(`service/kernels/native.py`) and called from numba's threads, one task per (token, KV head):
the query heads of a KV head share its key and value reads.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, prange

from service.kernels.native import compile_ir

LOG2E = 1.4426950408889634
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4  # ln 2 in two parts
LOWEST_EXPONENT = -87.0  # exp(-87) is about float32's smallest normal number
EXP_POLYNOMIAL = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)  # Cephes expf on [-ln2/2, ln2/2], highest degree first
VALUE_ACCUMULATORS = 16  # vector registers the value sums may hold (heads x head_dim / lanes)


def lanes_for(head_dim: int) -> int:
    """The vector width the kernel computes a head of `head_dim` with."""
    for lanes in (16, 8, 4):
        if head_dim % lanes == 0:
            return lanes
    raise ValueError(f"the attention kernel needs a head size divisible by 4, not {head_dim}")


class VectorIR:
    """An LLVM IR function under construction in vectors of `lanes` float32, with the helpers
    the attention kernels share (this module's and `chunk_attention_kernel.py`'s)."""

    def __init__(self, lanes: int, module_name: str) -> None:
        from llvmlite import ir

        self.ir, self.lanes = ir, lanes
        self.i32, self.i64, self.f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        self.vector = ir.VectorType(self.f32, self.lanes)
        self.module = ir.Module(name=module_name)
        v = self.vector
        self.fma = ir.Function(
            self.module, ir.FunctionType(v, [v, v, v]), name=f"llvm.fma.v{self.lanes}f32"
        )
        self.floor = ir.Function(
            self.module, ir.FunctionType(v, [v]), name=f"llvm.floor.v{self.lanes}f32"
        )
        self.maxnum = ir.Function(
            self.module, ir.FunctionType(v, [v, v]), name=f"llvm.maxnum.v{self.lanes}f32"
        )
        self.fabs = ir.Function(
            self.module, ir.FunctionType(v, [v]), name=f"llvm.fabs.v{self.lanes}f32"
        )
        self.copysign = ir.Function(
            self.module, ir.FunctionType(v, [v, v]), name=f"llvm.copysign.v{self.lanes}f32"
        )
        self.reduce_max = ir.Function(
            self.module,
            ir.FunctionType(self.f32, [v]),
            name=f"llvm.vector.reduce.fmax.v{self.lanes}f32",
        )

    def begin(self, name: str, arguments: list[Any]) -> None:
        """Start the function `name(arguments...)` returning nothing; `self.b` builds its body."""
        ir = self.ir
        self.function = ir.Function(
            self.module, ir.FunctionType(ir.VoidType(), arguments), name=name
        )
        self.b = ir.IRBuilder(self.function.append_basic_block("entry"))

    # -- small helpers -------------------------------------------------------------------
    def const(self, value: int) -> Any:
        return self.ir.Constant(self.i64, value)

    def splat(self, scalar: Any) -> Any:
        """`scalar` in every lane."""
        ir, b = self.ir, self.b
        vector = ir.VectorType(scalar.type, self.lanes)
        lanes = b.insert_element(ir.Constant(vector, None), scalar, ir.Constant(self.i32, 0))
        return b.shuffle_vector(
            lanes,
            ir.Constant(vector, None),
            ir.Constant(ir.VectorType(self.i32, self.lanes), [0] * self.lanes),
        )

    def filled(self, value: float) -> Any:
        return self.ir.Constant(self.vector, [value] * self.lanes)

    def load_vector(self, pointer: Any, offset: Any) -> Any:
        b = self.b
        return b.load(b.bitcast(b.gep(pointer, [offset]), self.vector.as_pointer()), align=4)

    def store_vector(self, value: Any, pointer: Any, offset: Any) -> None:
        b = self.b
        b.store(value, b.bitcast(b.gep(pointer, [offset]), self.vector.as_pointer()), align=4)

    def shuffle(self, a: Any, b_: Any, indices: list[int]) -> Any:
        ir = self.ir
        return self.b.shuffle_vector(
            a, b_, ir.Constant(ir.VectorType(self.i32, len(indices)), indices)
        )

    def loop(
        self, count: Any, name: str, initial: list[Any], body: Callable[[Any, list[Any]], list[Any]]
    ) -> list[Any]:
        """for i in range(count), carrying `initial` values through `body(i, values)`; the
        values after the loop."""
        b, function = self.b, self.function
        before = b.block
        head, inside, done = (
            function.append_basic_block(f"{name}_{part}") for part in ("head", "body", "done")
        )
        b.branch(head)
        b.position_at_end(head)
        index = b.phi(self.i64, name)
        index.add_incoming(self.const(0), before)
        carried = []
        for value in initial:
            phi = b.phi(value.type)
            phi.add_incoming(value, before)
            carried.append(phi)
        b.cbranch(b.icmp_signed("<", index, count), inside, done)
        b.position_at_end(inside)
        updated = body(index, carried)
        end = b.block
        index.add_incoming(b.add(index, self.const(1)), end)
        for phi, value in zip(carried, updated):
            phi.add_incoming(value, end)
        b.branch(head)
        b.position_at_end(done)
        return carried

    def exp(self, x: Any) -> Any:
        """exp(x) for x <= 0: 2^k * exp(r), r = x - k ln 2 in [-ln2/2, ln2/2]."""
        ir, b = self.ir, self.b
        x = self.maxnum_call(x, self.filled(LOWEST_EXPONENT))
        k = b.call(self.floor, [b.fadd(b.fmul(x, self.filled(LOG2E)), self.filled(0.5))])
        r = b.fsub(b.fsub(x, b.fmul(k, self.filled(LN2_HIGH))), b.fmul(k, self.filled(LN2_LOW)))
        p = self.filled(EXP_POLYNOMIAL[0])
        for coefficient in EXP_POLYNOMIAL[1:]:
            p = b.call(self.fma, [p, r, self.filled(coefficient)])
        e = b.fadd(b.fadd(b.fmul(b.fmul(p, r), r), r), self.filled(1.0))
        ints = ir.VectorType(self.i32, self.lanes)
        power = b.shl(
            b.add(b.fptosi(k, ints), ir.Constant(ints, [127] * self.lanes)),
            ir.Constant(ints, [23] * self.lanes),
        )
        return b.fmul(e, b.bitcast(power, self.vector))

    def soft_cap(self, x: Any, cap: float) -> Any:
        """cap * tanh(x / cap), Gemma 2's cap of its attention scores (transformers' order: the
        division, tanh, the product). tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) by
        `exp` (its argument is never positive): within a few float32 ulps of 1 in absolute
        terms, far below what a score's sum of products rounds."""
        b = self.b
        y = b.fdiv(x, self.filled(cap))
        e = self.exp(b.fmul(b.call(self.fabs, [y]), self.filled(-2.0)))
        one = self.filled(1.0)
        tanh = b.call(self.copysign, [b.fdiv(b.fsub(one, e), b.fadd(one, e)), y])
        return b.fmul(tanh, self.filled(cap))

    def scaled(self, sums: Any, scale: Any, cap: float) -> Any:
        """Scores from dot products: times `scale`, then capped at `cap` (0: uncapped)."""
        scores = self.b.fmul(sums, scale)
        return self.soft_cap(scores, cap) if cap else scores

    def maxnum_call(self, a: Any, b_: Any) -> Any:
        return self.b.call(self.maxnum, [a, b_])


class _Emitter(VectorIR):
    """Builds the IR of `attend(q, keys, values, start, tree, tree_len, scale, out, scores,
    positions)` for one token and one KV head: q [group, head_dim] its query heads, keys and
    values [capacity, head_dim] the KV head's row, `tree` [tree_len] the token's path columns,
    out [group, head_dim]; scores [group * padded] float32 and positions [padded] int64 are
    scratch, padded = n rounded up to `lanes`. Scores capped at `softcap` (0: uncapped)."""

    def __init__(self, head_dim: int, group: int, half: bool, softcap: float = 0.0) -> None:
        super().__init__(lanes_for(head_dim), "ngrammys_attention")
        ir = self.ir
        self.group, self.head_dim, self.chunks = group, head_dim, head_dim // self.lanes
        self.softcap = softcap
        self.entry = ir.HalfType() if half else ir.FloatType()  # the cache's keys and values
        f32p, i64p, entries = self.f32.as_pointer(), self.i64.as_pointer(), self.entry.as_pointer()
        self.begin(
            "attend",
            [f32p, entries, entries, self.i64, i64p, self.i64, ir.DoubleType(), f32p, f32p, i64p],
        )

    def load_entries(self, pointer: Any, offset: Any) -> Any:
        """`lanes` keys' or values' entries from the cache, as float32."""
        b = self.b
        if isinstance(self.entry, self.ir.FloatType):
            return self.load_vector(pointer, offset)
        entries = b.load(
            b.bitcast(
                b.gep(pointer, [offset]), self.ir.VectorType(self.entry, self.lanes).as_pointer()
            ),
            align=2,
        )
        return b.fpext(entries, self.vector)

    # -- the arithmetic --------------------------------------------------------------------
    def lane_sums(self, queries: list[list[Any]], keys: Any, columns: list[Any]) -> list[Any]:
        """Per query head, q·k for the keys at `columns` (a power of two, at most `lanes`) as
        one vector, key i's score in its i-th span of lanes (one lane each for `lanes` keys).
        Lane l of a key's product sums dims l, l + lanes, ... in order; then every key's lanes
        are added by the same tree: l and l + lanes/2, then the halves' halves, ... Emitted
        depth first, so each key's entries are loaded (and widened) once for all heads and few
        partial sums are live at a time."""
        b = self.b
        if len(columns) == 1:
            base = b.mul(columns[0], self.const(self.head_dim))
            key = [
                self.load_entries(keys, b.add(base, self.const(c * self.lanes)))
                for c in range(self.chunks)
            ]
            sums = []
            for query in queries:
                total = b.fmul(query[0], key[0])
                for c in range(1, self.chunks):
                    total = b.call(self.fma, [query[c], key[c], total])
                sums.append(total)
            return sums
        half = len(columns) // 2
        lows, highs = (
            self.lane_sums(queries, keys, columns[:half]),
            self.lane_sums(queries, keys, columns[half:]),
        )
        width = self.lanes // half  # lanes each key's partial sums span in a low or high vector
        firsts, seconds = [], []
        for source in (0, self.lanes):  # low's lanes, then high's, in the shuffle's numbering
            for span in range(0, self.lanes, width):
                firsts += range(source + span, source + span + width // 2)
                seconds += range(source + span + width // 2, source + span + width)
        return [
            b.fadd(self.shuffle(low, high, firsts), self.shuffle(low, high, seconds))
            for low, high in zip(lows, highs)
        ]

    def horizontal_sum(self, vector: Any) -> Any:
        """The sum of a vector's lanes by the tree `lane_sums` uses."""
        b, width = self.b, self.lanes
        while width > 1:
            width //= 2
            vector = b.fadd(
                self.shuffle(vector, vector, list(range(width))),
                self.shuffle(vector, vector, list(range(width, 2 * width))),
            )
        return b.extract_element(vector, self.ir.Constant(self.i32, 0))

    # -- the kernel ------------------------------------------------------------------------
    def build(self) -> str:
        ir, b, lanes = self.ir, self.b, self.lanes
        q, keys, values, start, tree, tree_len, scale64, out, scores, positions = self.function.args
        n = b.add(start, tree_len)
        blocks = b.udiv(b.add(n, self.const(lanes - 1)), self.const(lanes))
        padded = b.mul(blocks, self.const(lanes))
        scale = self.splat(b.fptrunc(scale64, self.f32))
        totals = b.alloca(self.f32, self.const(self.group))

        def committed(j: Any, _: list[Any]) -> list[Any]:
            b.store(j, b.gep(positions, [j]))
            return []

        def in_tree(t: Any, _: list[Any]) -> list[Any]:
            b.store(b.load(b.gep(tree, [t])), b.gep(positions, [b.add(start, t)]))
            return []

        last = b.sub(n, self.const(1))

        def tail(t: Any, _: list[Any]) -> list[Any]:  # padding repeats the last column
            b.store(b.load(b.gep(positions, [last])), b.gep(positions, [b.add(n, t)]))
            return []

        self.loop(start, "committed", [], committed)
        self.loop(tree_len, "tree", [], in_tree)
        self.loop(b.sub(padded, n), "tail", [], tail)
        lane_index = ir.Constant(ir.VectorType(self.i64, lanes), list(range(lanes)))

        queries = [
            [
                self.load_vector(q, self.const(h * self.head_dim + c * lanes))
                for c in range(self.chunks)
            ]
            for h in range(self.group)
        ]

        def score_block(
            block: Any, _: list[Any]
        ) -> list[Any]:  # every head, while the keys are in L1
            first = b.mul(block, self.const(lanes))
            columns = [
                b.load(b.gep(positions, [b.add(first, self.const(i))])) for i in range(lanes)
            ]
            for h, sums in enumerate(self.lane_sums(queries, keys, columns)):
                self.store_vector(
                    self.scaled(sums, scale, self.softcap),
                    scores,
                    b.add(b.mul(self.const(h), padded), first),
                )
            return []

        self.loop(blocks, "scores", [], score_block)

        def head(h: Any, _: list[Any]) -> list[Any]:
            row = b.gep(scores, [b.mul(h, padded)])
            (highest,) = self.loop(
                blocks,
                "max",
                [self.filled(float("-inf"))],
                lambda block, carried: [
                    self.maxnum_call(
                        carried[0], self.load_vector(row, b.mul(block, self.const(lanes)))
                    )
                ],
            )
            highest = self.splat(b.call(self.reduce_max, [highest]))

            def exponentials(block: Any, carried: list[Any]) -> list[Any]:
                first = b.mul(block, self.const(lanes))
                e = self.exp(b.fsub(self.load_vector(row, first), highest))
                inside = b.icmp_signed("<", b.add(self.splat(first), lane_index), self.splat(n))
                e = b.select(inside, e, self.filled(0.0))
                self.store_vector(e, row, first)
                return [b.fadd(carried[0], e)]

            (sums,) = self.loop(blocks, "exp", [self.filled(0.0)], exponentials)
            b.store(self.horizontal_sum(sums), b.gep(totals, [h]))
            return []

        self.loop(self.const(self.group), "heads", [], head)
        per_call = max(1, VALUE_ACCUMULATORS // self.chunks)
        for first_head in range(0, self.group, per_call):
            self.weighted_values(
                list(range(first_head, min(self.group, first_head + per_call))),
                values,
                n,
                padded,
                scores,
                positions,
                totals,
                out,
            )
        b.ret_void()
        return str(self.module)

    def weighted_values(
        self,
        heads: list[int],
        values: Any,
        n: Any,
        padded: Any,
        scores: Any,
        positions: Any,
        totals: Any,
        out: Any,
    ) -> None:
        """out[h] = Σ_j p_j v_j / total_h for `heads`, the value rows read once for them all."""
        b, lanes = self.b, self.lanes

        def column(j: Any, carried: list[Any]) -> list[Any]:
            base = b.mul(b.load(b.gep(positions, [j])), self.const(self.head_dim))
            value = [
                self.load_entries(values, b.add(base, self.const(c * lanes)))
                for c in range(self.chunks)
            ]
            updated = []
            for i, h in enumerate(heads):
                p = self.splat(b.load(b.gep(scores, [b.add(b.mul(self.const(h), padded), j)])))
                updated += [
                    b.call(self.fma, [p, value[c], carried[i * self.chunks + c]])
                    for c in range(self.chunks)
                ]
            return updated

        sums = self.loop(
            n, f"values{heads[0]}", [self.filled(0.0)] * (len(heads) * self.chunks), column
        )
        for i, h in enumerate(heads):
            total = self.splat(b.load(b.gep(totals, [self.const(h)])))
            for c in range(self.chunks):
                self.store_vector(
                    b.fdiv(sums[i * self.chunks + c], total),
                    out,
                    self.const(h * self.head_dim + c * lanes),
                )


@functools.cache
def token_attention(head_dim: int, group: int, half: bool = False, softcap: float = 0.0) -> Any:
    """`token_attention(head_dim, group, half, softcap)(queries, keys, values, tokens, rows,
    starts, columns, column_offsets, scale, out)`: attention of the flat tokens `tokens` [n] of
    a pass, each score capped at `softcap` (Gemma 2's; 0: uncapped).

    queries [T, heads, head_dim]; keys, values [rows, kv_heads, capacity, head_dim] (the cache's
    whole buffers: float32, or with `half` float16 as uint16 bits), heads = group * kv_heads;
    token i attends to columns [0, starts[i]) of row rows[i], then to
    columns[column_offsets[i]:column_offsets[i + 1]] (its tree path, ascending). Writes
    out[tokens[i]] [heads, head_dim]. One task per (token, KV head) over numba's threads."""
    pointer = ctypes.c_int64
    attend = compile_ir(
        _Emitter(head_dim, group, half, softcap).build(),
        "attend",
        [
            pointer,
            pointer,
            pointer,
            ctypes.c_int64,
            pointer,
            ctypes.c_int64,
            ctypes.c_double,
            pointer,
            pointer,
            pointer,
        ],
    )
    lanes = lanes_for(head_dim)

    @njit(parallel=True, nogil=True)
    def attention(
        queries, keys, values, tokens, rows, starts, columns, column_offsets, scale, out
    ):  # pragma: no cover - compiled
        kv_heads = keys.shape[1]
        for task in prange(tokens.shape[0] * kv_heads):
            i, kv_head = task // kv_heads, task % kv_heads
            token, row, start = tokens[i], rows[i], starts[i]
            path = columns[column_offsets[i] : column_offsets[i + 1]]
            padded = (start + path.shape[0] + lanes - 1) // lanes * lanes
            scores = np.empty(group * padded, np.float32)
            positions = np.empty(padded, np.int64)
            attend(
                queries[token, kv_head * group :].ctypes.data,
                keys[row, kv_head].ctypes.data,
                values[row, kv_head].ctypes.data,
                start,
                path.ctypes.data,
                path.shape[0],
                np.float64(scale),
                out[token, kv_head * group :].ctypes.data,
                scores.ctypes.data,
                positions.ctypes.data,
            )

    return attention


def warm_up(head_dim: int, group: int, half: bool, softcap: float = 0.0) -> None:
    """Build and compile the kernel for a model's heads (and cap) now (LLVM, then numba for
    these argument types), not in the first request's pass."""
    index = np.zeros(1, np.int64)
    queries = np.zeros((1, group, head_dim), np.float32)
    cache = np.zeros((1, 1, 1, head_dim), np.uint16 if half else np.float32)
    token_attention(head_dim, group, half, softcap)(
        queries,
        cache,
        cache,
        index,
        index,
        index,
        index,
        np.array([0, 1]),
        np.float32(1.0),
        np.empty_like(queries),
    )
