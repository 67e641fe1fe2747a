"""Q4_1 linears computed with 8-bit activations on AVX-512 VNNI (`--quantization gguf-int8`).

On a CPU the packed Q4_1 kernel of `service/kernels/packed_kernels.py` multiplies in float32:
past a few rows a pass is bound by float32 multiply-adds, and a tree of 16 tokens costs several
one-token passes (docs/benchmarks.md, "The 8-bit linears"). VNNI's `vpdpbusd` multiplies 64 unsigned
bytes by 64 signed bytes and adds them in fours into 16 int32 lanes: 64 multiply-adds an
instruction. llama.cpp computes its Q4_1 dot products that way, with each activation row
quantized to 8 bits per block of 32 (a float scale per block); so does this module.

The weights stay exactly the GGUF's (w = d*q + m, q the 4-bit value); only the activations
entering a Q4_1 linear are rounded, per row and per block of 32: dx = max|x| / 127,
xq = round(x / dx). Then for each output column and block, Σ q·xq is exact in int32, and
y = Σ_blocks (d·dx)·Σ q·xq + m·(dx·Σ xq), the float part in one fixed order. Each row is
computed alone, so a row's result does not depend on the pass (speculation reproduces plain
decoding of this path bit for bit); it differs from the float32 path's by the rounding of the
activations, as llama.cpp's does.

The inner kernel is LLVM IR built here with llvmlite (numba's own compiler: nothing to
install) and compiled for this CPU at load: numba's vectorizer emits no `vpdpbusd` from
scalar code (an int16 pair-product loop stayed scalar, slower than the float kernel), so the
IR calls the intrinsic itself. Weights are re-laid at load into tiles of 16 output columns:
per block of 32 inputs, four 64-byte vectors, byte 4c+i of vector g holding column c's
weights 4g+i (low nibble) and 16+4g+i (high nibble). numba's threads split the tiles.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, prange

from service.kernels.native import compile_ir

COLUMNS = 16  # output columns of a tile: one vector of 16 int32 / float32 lanes
BLOCK = 32  # inputs per block (Q4_1's, and the activations' scale)
TILE_BYTES = BLOCK * COLUMNS // 2  # a block of a tile: 4 vectors of 64 bytes
# Rows sharing each loaded (and unpacked) block, largest first, while a whole group is left
# (their accumulators and the block fit 32 registers). Passes of 8 rows or more take
# `int8_chunk_kernel.py`, which groups 8.
ROW_GROUPS = (4, 1)
REQUIRED_FEATURES = ("avx512f", "avx512bw", "avx512vnni")


def int8_supported() -> bool:
    """Whether this CPU has the instructions the kernel is built from."""
    try:
        import llvmlite.binding as llvm
    except ImportError:  # pragma: no cover - numba always brings llvmlite
        return False
    features = llvm.get_host_cpu_features()
    return all(features.get(name, False) for name in REQUIRED_FEATURES)


@dataclass(frozen=True)
class Int8Tiles:
    """A Q4_1 or Q8_0 weight [out_features, in_features] re-laid for the kernel."""

    kind: str
    packed: np.ndarray  # [U, B, 256 (Q4_1) or 512 (Q8_0)] uint8: tile u, block b (module docstring)
    d: np.ndarray  # [U, B, 16] float32 scales of the tile's columns
    # [U, B, 16] Q4_1: float32 mins; Q8_0: int32 -128·Σ w (activations enter as xq + 128)
    m: np.ndarray
    out_features: int
    in_features: int


def int8_tiles(
    kind: str, qs: np.ndarray, d: np.ndarray, m: np.ndarray, out_features: int
) -> Int8Tiles:
    """Re-lay `PackedTiles`' arrays into the kernel's tiles: Q4_1 qs [T, B, 16, 32] (byte j of
    a block: low nibble weight j, high nibble weight j+16), Q8_0 qs [T, B, 32, 32] int8; d, m
    [T, B, 32]."""
    tiles, blocks, _, width = qs.shape

    def columns(a: np.ndarray, dtype: type) -> np.ndarray:  # [T, B, width] -> [U, B, 16]
        a = a.transpose(0, 2, 1).reshape(-1, COLUMNS, blocks)
        return np.ascontiguousarray(a.transpose(0, 2, 1), dtype=dtype)

    if kind == "Q8_0":
        q = qs.transpose(0, 3, 1, 2).reshape(-1, COLUMNS, blocks, 8, 4)  # [U, c, B, g, i]
        packed = np.ascontiguousarray(
            q.transpose(0, 2, 3, 1, 4).reshape(-1, blocks, 2 * TILE_BYTES)
        ).view(np.uint8)
        bias = -128 * qs.astype(np.int32).sum(axis=2)  # [T, B, width]
        return Int8Tiles(
            kind,
            packed,
            columns(d, np.float32),
            columns(bias, np.int32),
            out_features,
            blocks * BLOCK,
        )
    q = np.concatenate([qs & 15, qs >> 4], axis=2)  # [T, B, 32 inputs, width columns]
    q = q.transpose(0, 3, 1, 2).reshape(-1, COLUMNS, blocks, 2, 4, 4)  # [U, c, B, half, g, i]
    packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [U, c, B, g, i]
    packed = np.ascontiguousarray(packed.transpose(0, 2, 3, 1, 4).reshape(-1, blocks, TILE_BYTES))
    return Int8Tiles(
        kind, packed, columns(d, np.float32), columns(m, np.float32), out_features, blocks * BLOCK
    )


@njit(cache=True, nogil=True)
def quantize_rows(x, xq, dx, xs):  # pragma: no cover - compiled
    """Each row of x [R, K] per block of 32: dx = max|x| / 127, xq = round(x / dx) (half away
    from zero), xs = dx * Σ xq."""
    rows, width = x.shape
    for r in range(rows):
        for b in range(width // BLOCK):
            amax = np.float32(0.0)
            for j in range(BLOCK):
                amax = max(amax, abs(x[r, b * BLOCK + j]))
            scale = amax / np.float32(127.0)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            total = 0
            for j in range(BLOCK):
                v = x[r, b * BLOCK + j] * inverse
                q = int(np.floor(abs(v) + np.float32(0.5)))
                q = min(q, 127)
                q = -q if v < 0 else q
                xq[r, b * BLOCK + j] = q
                total += q
            dx[r, b] = scale
            xs[r, b] = scale * np.float32(total)


Addresses = Callable[[Any, Sequence[Any], Any, int, Any], tuple[Any, Any, Any]]


def row_major(b: Any, arrays: Sequence[Any], row: Any, r: int, block: Any) -> tuple[Any, Any, Any]:
    """Where row `row + r`'s block `block` of quantized inputs, its dx and its dx·Σxq are, for
    `arrays` = (xq [R, K], dx [R, K/32], xs [R, K/32]) and `blocks` = K/32, row-major."""
    from llvmlite import ir

    xq, dx, xs, blocks = arrays
    i64 = ir.IntType(64)
    this_row = b.add(row, ir.Constant(i64, r))
    row_block = b.add(b.mul(this_row, blocks), block)
    return (
        b.gep(xq, [b.mul(row_block, ir.Constant(i64, BLOCK))]),
        b.gep(dx, [row_block]),
        b.gep(xs, [row_block]),
    )


def _ir(kind: str, row_groups: Sequence[int] = ROW_GROUPS, addresses: Addresses = row_major) -> str:
    """The tile kernel's LLVM IR: tiles(packed, d, m, xq, dx, xs, out, rows, blocks,
    out_stride, count) computes out[r, 16u : 16u + 16] for the `count` tiles from `packed`.
    Q4_1: weights (nibbles, unsigned) times xq (signed), plus m·xs; Q8_0: xq + 128 (unsigned)
    times the weights (signed), the sums starting from m = -128·Σ w. Rows go `row_groups` at a
    time through each block (the largest first, while a whole group is left), so a block's
    weights are loaded (and unpacked) once for the group; every row's arithmetic is the same in
    a group as alone. `addresses` says where a row's inputs are (`row_major` by default; see
    `service/kernels/int8_chunk_kernel.py` for the other layout)."""
    from llvmlite import ir

    i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
    bytes64, ints, floats = ir.VectorType(i8, 64), ir.VectorType(i32, 16), ir.VectorType(f32, 16)
    module = ir.Module(name="ngrammys_int8")
    dot = ir.Function(
        module, ir.FunctionType(ints, [ints, bytes64, bytes64]), name="llvm.x86.avx512.vpdpbusd.512"
    )
    fma = ir.Function(
        module, ir.FunctionType(floats, [floats, floats, floats]), name="llvm.fma.v16f32"
    )
    args = [
        i8.as_pointer(),
        f32.as_pointer(),
        i8.as_pointer(),
        i8.as_pointer(),
        f32.as_pointer(),
        f32.as_pointer(),
        f32.as_pointer(),
        i64,
        i64,
        i64,
        i64,
    ]
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name="tiles")
    packed0, d0, m0, xq, dx, xs, out0, rows, blocks, out_stride, count = function.args
    const = lambda value: ir.Constant(i64, value)  # noqa: E731
    block_bytes = TILE_BYTES if kind == "Q4_1" else 2 * TILE_BYTES
    start, tile_head = function.append_basic_block("start"), function.append_basic_block("tile")
    ir.IRBuilder(start).branch(tile_head)

    b = ir.IRBuilder(tile_head)
    tile = b.phi(i64, "tile")
    tile.add_incoming(const(0), start)
    packed = b.gep(packed0, [b.mul(tile, b.mul(blocks, const(block_bytes)))])
    d = b.gep(d0, [b.mul(tile, b.mul(blocks, const(COLUMNS)))])
    m = b.gep(
        b.bitcast(m0, (f32 if kind == "Q4_1" else i32).as_pointer()),
        [b.mul(tile, b.mul(blocks, const(COLUMNS)))],
    )
    out = b.gep(out0, [b.mul(tile, const(COLUMNS))])

    def rows_loop(entry: Any, first_row: Any, group: int) -> tuple[Any, Any]:
        """Rows `group` at a time from `first_row` while a whole group fits; returns the exit
        block and the first row left."""
        head, body, stored, leave = (
            function.append_basic_block(f"{name}{group}")
            for name in ("rows", "block", "stored", "left")
        )
        b = ir.IRBuilder(entry)
        b.branch(head)
        b = ir.IRBuilder(head)
        row = b.phi(i64, "row")
        row.add_incoming(first_row, entry)
        b.cbranch(b.icmp_unsigned("<=", b.add(row, const(group)), rows), body, leave)

        b = ir.IRBuilder(body)
        block = b.phi(i64, "block")
        block.add_incoming(const(0), head)
        totals = [b.phi(floats, f"total{r}") for r in range(group)]
        for total in totals:
            total.add_incoming(ir.Constant(floats, [0.0] * COLUMNS), head)
        weights = b.gep(packed, [b.mul(block, const(block_bytes))])
        scales = b.load(
            b.bitcast(b.gep(d, [b.mul(block, const(COLUMNS))]), floats.as_pointer()), align=4
        )
        column_terms = b.load(
            b.bitcast(
                b.gep(m, [b.mul(block, const(COLUMNS))]),
                (floats if kind == "Q4_1" else ints).as_pointer(),
            ),
            align=4,
        )

        def splat(pointer: Any) -> Any:
            lanes = b.insert_element(
                ir.Constant(floats, None), b.load(pointer), ir.Constant(i32, 0)
            )
            return b.shuffle_vector(
                lanes, ir.Constant(floats, None), ir.Constant(ints, [0] * COLUMNS)
            )

        vectors = [
            b.load(b.bitcast(b.gep(weights, [const(64 * g)]), bytes64.as_pointer()), align=1)
            for g in range(block_bytes // 64)
        ]
        if kind == "Q4_1":  # (weights, input offset) pairs: low nibbles 4g.., high ones 16+4g..
            nibble, four = ir.Constant(bytes64, [15] * 64), ir.Constant(bytes64, [4] * 64)
            operands = [(b.and_(v, nibble), 4 * g) for g, v in enumerate(vectors)]
            operands += [
                (b.and_(b.lshr(v, four), nibble), BLOCK // 2 + 4 * g) for g, v in enumerate(vectors)
            ]
        else:
            operands = [(v, 4 * g) for g, v in enumerate(vectors)]
        news = []
        for r, total in enumerate(totals):
            inputs, row_dx, row_xs = addresses(b, (xq, dx, xs, blocks), row, r, block)
            sums = ir.Constant(ints, [0] * COLUMNS) if kind == "Q4_1" else column_terms
            for weight, offset in operands:  # xq[offset : offset + 4] in every 32-bit lane
                word = b.load(b.bitcast(b.gep(inputs, [const(offset)]), i32.as_pointer()), align=1)
                lanes = b.insert_element(ir.Constant(ints, None), word, ir.Constant(i32, 0))
                four_inputs = b.bitcast(
                    b.shuffle_vector(
                        lanes, ir.Constant(ints, None), ir.Constant(ints, [0] * COLUMNS)
                    ),
                    bytes64,
                )
                # unsigned first
                pair = [weight, four_inputs] if kind == "Q4_1" else [four_inputs, weight]
                sums = b.call(dot, [sums, *pair])
            new = b.call(fma, [b.sitofp(sums, floats), b.fmul(scales, splat(row_dx)), total])
            if kind == "Q4_1":
                new = b.call(fma, [column_terms, splat(row_xs), new])
            news.append(new)
        block_next = b.add(block, const(1))
        block.add_incoming(block_next, body)
        for total, new in zip(totals, news):
            total.add_incoming(new, body)
        b.cbranch(b.icmp_unsigned("<", block_next, blocks), body, stored)

        b = ir.IRBuilder(stored)
        for r, new in enumerate(news):
            b.store(
                new,
                b.bitcast(
                    b.gep(out, [b.mul(b.add(row, const(r)), out_stride)]), floats.as_pointer()
                ),
                align=4,
            )
        row_next = b.add(row, const(group))
        row.add_incoming(row_next, stored)
        b.branch(head)
        return leave, row

    left, row = tile_head, const(0)
    for group in row_groups:
        left, row = rows_loop(left, row, group)

    b = ir.IRBuilder(left)
    tile_next = b.add(tile, const(1))
    tile.add_incoming(tile_next, left)
    done = function.append_basic_block("done")
    b.cbranch(b.icmp_unsigned("<", tile_next, count), tile_head, done)
    ir.IRBuilder(done).ret_void()
    return str(module)


@functools.cache
def int8_matmul(kind: str = "Q4_1") -> Any:
    """`int8_matmul(kind)(x, packed, d, m, out, chunks)`: out[R, 16U] = x[R, K] @ W.T for
    the weight of (packed, d, m) (`Int8Tiles` of that kind), x quantized per row and block
    first; the tiles split into `chunks` parts over numba's threads (0 or 1: the calling
    thread)."""
    if not int8_supported():
        raise RuntimeError(
            f"--quantization gguf-int8 needs a CPU with {', '.join(REQUIRED_FEATURES)}"
        )
    tiles_kernel = compile_ir(_ir(kind), "tiles", [ctypes.c_int64] * 11)
    offset = 0 if kind == "Q4_1" else 128  # Q8_0: the activations are the unsigned operand

    @njit(nogil=True)
    def matmul(x, packed, d, m, out, chunks):  # pragma: no cover - compiled
        rows, width = x.shape
        blocks = width // BLOCK
        xq = np.empty((rows, width), np.int8)
        dx = np.empty((rows, blocks), np.float32)
        xs = np.empty((rows, blocks), np.float32)
        quantize_rows(x, xq, dx, xs)
        if offset:
            shifted = xq.view(np.uint8)
            for r in range(rows):
                for k in range(width):
                    shifted[r, k] = np.uint8(xq[r, k] + offset)
        split_tiles(
            tiles_kernel,
            packed,
            d,
            m,
            xq.ctypes.data,
            dx.ctypes.data,
            xs.ctypes.data,
            out,
            rows,
            blocks,
            chunks,
        )

    return matmul


@njit(parallel=True, nogil=True)
def split_tiles(
    tiles_kernel, packed, d, m, inputs, dx, xs, out, rows, blocks, chunks
):  # pragma: no cover - compiled
    """`tiles_kernel` (`_ir`'s) over the tiles of (packed, d, m) in `chunks` parts of
    consecutive tiles over numba's threads (0 or 1: the calling thread); inputs, dx, xs: the
    activations' pointers it takes, rows of them."""
    tiles = packed.shape[0]
    parts = max(chunks, 1)
    per_part = (tiles + parts - 1) // parts
    for part in prange(parts):
        first = part * per_part
        last = min(tiles, first + per_part)
        if first < last:
            tiles_kernel(
                packed[first:].ctypes.data,
                d[first:].ctypes.data,
                m[first:].ctypes.data,
                inputs,
                dx,
                xs,
                out[:, first * COLUMNS :].ctypes.data,
                rows,
                blocks,
                out.shape[1],
                last - first,
            )


def warm_up() -> None:
    """Build and compile both kinds' kernels now (LLVM, then numba, which cannot cache code
    that calls into this process's own machine code), not in the first request's pass, which
    would otherwise wait seconds for them."""
    x = np.zeros((1, BLOCK), np.float32)
    for kind, block_bytes, extra in (
        ("Q4_1", TILE_BYTES, np.float32),
        ("Q8_0", 2 * TILE_BYTES, np.int32),
    ):
        scales = np.zeros((1, 1, COLUMNS), np.float32)
        int8_matmul(kind)(
            x,
            np.zeros((1, 1, block_bytes), np.uint8),
            scales,
            np.zeros((1, 1, COLUMNS), extra),
            np.empty((1, COLUMNS), np.float32),
            0,
        )
