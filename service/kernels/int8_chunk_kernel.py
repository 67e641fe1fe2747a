"""Linears with 8-bit activations for passes of many rows (prompt chunks, large trees).

`service/kernels/int8_kernel.py` serves every pass size, but runs a prompt chunk far below
the rate the cores' `vpdpbusd` allows (docs/benchmarks.md, "Prompt tokens' own kernels").
Two changes close much of that gap:
- the activations are quantized by vector IR, rows split over the threads, not by a scalar
  numba loop on one thread (which took a large share of the down projection's time);
- the quantized rows are laid out per group of `GROUP` rows and block: one record holds the
  group's 32 bytes a row, then their scales dx and their dx·Σxq (`RECORD_BYTES`), so a single
  pointer walking the records reaches every input at a constant displacement. Row-major
  inputs' addresses need an index register, which Intel cores split into two micro-ops: the
  same instruction mix ran markedly slower on them.

The arithmetic is `int8_kernel`'s to the bit: the same rounding of the activations, the same
exact integer sums, and per block the same float steps, total = fma(Σ, d·dx, total) then
fma(m, dx·Σxq, total). So a row's result does not depend on which kernel its pass took: a
decode row batched with a prompt chunk, and a prompt token, get the same bits as alone, and
speculation stays exact. Rows are padded with zero rows to a whole group (their outputs are
dropped).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numba import njit, prange

from service.kernels.int8_kernel import (
    BLOCK,
    FLOAT_MINS,
    SCALED_BITS,
    Int8Tiles,
    Isa,
    _ir,
    _required_isa,
    split_tiles,
    weight_offset,
)
from service.kernels.native import compile_ir

# rows sharing each block's weights: 8 sums, 8 totals and 8 weight vectors fill AVX-512's
# registers; on AVX2 (16) some spill, and yet 8 measured faster than 2 or 4 (docs/benchmarks.md)
GROUP = 8
SCALES_AT = GROUP * BLOCK  # a record: GROUP rows x 32 int8, GROUP float32 dx, GROUP float32 dx·Σxq
SUMS_AT = SCALES_AT + 4 * GROUP
RECORD_BYTES = SUMS_AT + 4 * GROUP
# Passes of at least this many rows take this kernel: from a whole group on it beat the other at
# each of the embedded model's layer shapes (docs/benchmarks.md), so trees of 8 nodes and more
# gain too; below, padding to a whole group would cost more.
CHUNK_MIN_ROWS = GROUP


def _quantize_ir(halves: bool = False) -> str:
    """`quantize(x, records, row, blocks)`: one row of x (float32, blocks * 32) into its place
    `row` (< GROUP) of its group's records, which start at `records`: per block of 32,
    dx = max|x| / 127, xq = round(x / dx) half away from zero, dx·Σxq; `int8_kernel.quantize_rows`'
    steps, in vector lanes. With `halves`, the block's two half sums of xq as one int32 instead
    of dx·Σxq (`int8_kernel.half_sums`: for weights stored offset)."""
    from llvmlite import ir

    i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
    floats, ints, bytes16 = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
    module = ir.Module(name="ngrammys_int8_quantize")
    fabs = ir.Function(module, ir.FunctionType(floats, [floats]), name="llvm.fabs.v16f32")
    floor = ir.Function(module, ir.FunctionType(floats, [floats]), name="llvm.floor.v16f32")
    umax = ir.Function(module, ir.FunctionType(ints, [ints, ints]), name="llvm.umax.v16i32")
    minnum = ir.Function(
        module, ir.FunctionType(floats, [floats, floats]), name="llvm.minnum.v16f32"
    )
    reduce_max = ir.Function(
        module, ir.FunctionType(i32, [ints]), name="llvm.vector.reduce.umax.v16i32"
    )
    reduce_add = ir.Function(
        module, ir.FunctionType(i32, [ints]), name="llvm.vector.reduce.add.v16i32"
    )
    function = ir.Function(
        module,
        ir.FunctionType(ir.VoidType(), [f32.as_pointer(), i8.as_pointer(), i64, i64]),
        name="quantize",
    )
    x, records, row, blocks = function.args
    entry, body, done = (function.append_basic_block(name) for name in ("entry", "body", "done"))
    ir.IRBuilder(entry).branch(body)
    b = ir.IRBuilder(body)
    block = b.phi(i64, "block")
    block.add_incoming(ir.Constant(i64, 0), entry)

    def splat(scalar: Any) -> Any:
        lanes = b.insert_element(ir.Constant(floats, None), scalar, ir.Constant(i32, 0))
        return b.shuffle_vector(lanes, ir.Constant(floats, None), ir.Constant(ints, [0] * 16))

    values = [
        b.load(
            b.bitcast(
                b.gep(x, [b.add(b.mul(block, ir.Constant(i64, BLOCK)), ir.Constant(i64, 16 * h))]),
                floats.as_pointer(),
            ),
            align=4,
        )
        for h in (0, 1)
    ]
    # max |x| on the bits: non-negative floats order as their bits do (a float reduction
    # compiles to a scalar chain, for the NaN rules)
    magnitudes = [b.bitcast(b.call(fabs, [value]), ints) for value in values]
    amax = b.bitcast(b.call(reduce_max, [b.call(umax, magnitudes)]), f32)
    scale = b.fdiv(amax, ir.Constant(f32, 127.0))
    positive = b.fcmp_ordered(">", scale, ir.Constant(f32, 0.0))
    inverse = b.select(positive, b.fdiv(ir.Constant(f32, 1.0), scale), ir.Constant(f32, 0.0))
    record = b.gep(records, [b.mul(block, ir.Constant(i64, RECORD_BYTES))])
    here = b.gep(record, [b.mul(row, ir.Constant(i64, BLOCK))])
    total = ir.Constant(ints, [0] * 16)
    half_totals = []
    for h, value in enumerate(values):
        v = b.fmul(value, splat(inverse))
        q = b.call(
            minnum,
            [
                b.call(floor, [b.fadd(b.call(fabs, [v]), ir.Constant(floats, [0.5] * 16))]),
                ir.Constant(floats, [127.0] * 16),
            ],
        )
        magnitude = b.fptosi(q, ints)
        signed = b.select(
            b.fcmp_ordered("<", v, ir.Constant(floats, [0.0] * 16)), b.neg(magnitude), magnitude
        )
        total = b.add(total, signed)
        half_totals.append(b.call(reduce_add, [signed]))
        b.store(
            b.trunc(signed, bytes16),
            b.bitcast(b.gep(here, [ir.Constant(i64, 16 * h)]), bytes16.as_pointer()),
            align=1,
        )
    if halves:  # low half in the low 16 bits, as `int8_kernel.half_sums` packs them
        low = b.and_(half_totals[0], ir.Constant(i32, 0xFFFF))
        sums = b.bitcast(b.or_(low, b.shl(half_totals[1], ir.Constant(i32, 16))), f32)
    else:
        sums = b.fmul(scale, b.sitofp(b.call(reduce_add, [total]), f32))
    for at, value in ((SCALES_AT, scale), (SUMS_AT, sums)):
        b.store(
            value,
            b.gep(b.bitcast(b.gep(record, [ir.Constant(i64, at)]), f32.as_pointer()), [row]),
            align=4,
        )
    block_next = b.add(block, ir.Constant(i64, 1))
    block.add_incoming(block_next, body)
    b.cbranch(b.icmp_unsigned("<", block_next, blocks), body, done)
    ir.IRBuilder(done).ret_void()
    return str(module)


def records(b: Any, arrays: Sequence[Any], row: Any, r: int, block: Any) -> tuple[Any, Any, Any]:
    """`int8_kernel.row_major`'s counterpart for the records (`arrays`[0] points at them; `row` is
    a group's first row): every address a constant displacement from the group's record."""
    from llvmlite import ir

    first, _, _, blocks = arrays
    i64, f32p = ir.IntType(64), ir.FloatType().as_pointer()
    group = b.udiv(row, ir.Constant(i64, GROUP))
    record = b.gep(
        first, [b.mul(b.add(b.mul(group, blocks), block), ir.Constant(i64, RECORD_BYTES))]
    )
    scales, sums = (
        b.bitcast(b.gep(record, [ir.Constant(i64, at + 4 * r)]), f32p)
        for at in (SCALES_AT, SUMS_AT)
    )
    return b.gep(record, [ir.Constant(i64, BLOCK * r)]), scales, sums


# the `Int8Tiles` kinds this kernel serves: all of them
CHUNK_KINDS = (*FLOAT_MINS, "Q4_0", "Q5_0", "Q8_0", *SCALED_BITS)


def chunk_matmul(isa: Isa | None = None, kind: str = "Q4_1", half: bool = False) -> Any:
    """`chunk_matmul(isa, kind, half)(x, packed, d, m, out, chunks)`: out[:R, C·U] = x[R, K] @
    W.T for an `Int8Tiles` (packed, d, m) of `kind` (`CHUNK_KINDS`), `isa` (this CPU's best by
    default) and scales (`half`: float16), as `int8_kernel.int8_matmul(kind, isa, half)`
    computes it; `out` has room for R rounded up to a whole `GROUP` of rows. The rows are
    quantized over numba's threads, then the tiles split into `chunks` parts over them (0 or 1:
    the calling thread)."""
    assert kind in CHUNK_KINDS
    return _chunk_matmul(isa or _required_isa(), kind, half)


def chunk_matmul_of(tiles: Int8Tiles) -> Any | None:
    """`chunk_matmul` for `tiles`, or None where their kind has none."""
    if tiles.kind not in CHUNK_KINDS:
        return None
    return chunk_matmul(tiles.isa, tiles.kind, tiles.half_scales)


@functools.cache
def _chunk_matmul(isa: Isa, kind: str, half: bool) -> Any:
    halves = weight_offset(kind, isa) > 0
    quantize = compile_ir(_quantize_ir(halves), "quantize", [ctypes.c_int64] * 4)
    tiles_kernel = compile_ir(
        _ir(kind, isa, (GROUP,), records, half), "tiles", [ctypes.c_int64] * 11
    )

    @njit(parallel=True, nogil=True)
    def matmul(x, packed, d, m, out, chunks):  # pragma: no cover - compiled
        rows, width = x.shape
        blocks = width // BLOCK
        groups = (rows + GROUP - 1) // GROUP
        laid = np.empty((groups, blocks, RECORD_BYTES), np.uint8)
        laid[groups - 1] = 0  # padding rows: zero inputs and scales
        for r in prange(rows):
            quantize(x[r:].ctypes.data, laid[r // GROUP].ctypes.data, r % GROUP, blocks)
        split_tiles(
            tiles_kernel, packed, d, m, laid.ctypes.data, 0, 0, out, groups * GROUP, blocks, chunks
        )

    return matmul


def warm_up(served: Iterable[Int8Tiles]) -> None:
    """Build and compile the kernels of the `served` tiles (those of `CHUNK_KINDS`) now, not in
    the first long prompt's pass (like `int8_kernel.warm_up`)."""
    keys = {(t.kind, t.isa, t.half_scales) for t in served if t.kind in CHUNK_KINDS}
    for kind, isa, half in sorted(keys, key=str):
        scales = np.zeros((1, 1, isa.columns), np.uint16 if half else np.float32)
        chunk_matmul(isa, kind, half)(
            np.zeros((1, BLOCK), np.float32),
            np.zeros((1, 1, isa.block_bytes(kind)), np.uint8),
            scales,
            scales,
            np.empty((GROUP, isa.columns), np.float32),
            0,
        )
