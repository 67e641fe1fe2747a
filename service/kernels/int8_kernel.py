"""Packed linears (Q4_0, Q4_1, Q8_0, Q8_1, Q5_0, Q6_K and Q3_K layouts, and Q4_K and Q5_K scales)
computed with 8-bit activations (`--quantization gguf-int8`).

On a CPU the packed Q4_1 kernel of `service/kernels/packed_kernels.py` multiplies in float32:
past a few rows a pass is bound by float32 multiply-adds, and a tree of 16 tokens costs several
one-token passes (docs/benchmarks.md, "The 8-bit linears"). Integer vector instructions do four
times the multiply-adds of a float32 one: AVX-512 VNNI's `vpdpbusd` multiplies 64 unsigned bytes
by 64 signed bytes and adds them in fours into 16 int32 lanes; AVX2's `vpmaddubsw` multiplies 32
byte pairs and adds them in pairs into 16 int16 lanes (`vpmaddwd` by ones then adds those in
pairs into 8 int32). llama.cpp computes its dot products that way, with each activation row
quantized to 8 bits per block of 32 (a float scale per block); so does this module, on
whichever of the two the CPU has (`Isa`, VNNI first).

The weights stay exactly the GGUF's (w = d*q + m, q the 4-bit value); only the activations
entering a packed linear are rounded, per row and per block of 32: dx = max|x| / 127,
xq = round(x / dx). Then for each output column and block, Σ q·xq is exact in int32, and
y = Σ_blocks (d·dx)·Σ q·xq + m·(dx·Σ xq), the float part in one fixed order. Both instruction
sets reach the same exact integers, so the two compute the same bits. Each row is computed
alone, so a row's result does not depend on the pass (speculation reproduces plain decoding of
this path bit for bit); it differs from the float32 path's by the rounding of the activations,
as llama.cpp's does.

On AVX2 no product pair may leave int16 (`vpmaddubsw` saturates): a Q4_1 block's pairs are at
most 2·15·127 = 3810, so a block's eight products are summed in int16 (≤ 30480) before one
`vpmaddwd`; a Q8_0 weight (down to -128) times an unsigned activation byte could reach 65280,
so Q8_0 takes llama.cpp's sign trick: |w| (unsigned) times xq with w's sign, ≤ 2·128·127.
VNNI sums in int32 from the first product, so there a signed kind's weights enter as the bytes
w + c (Q8_0's c = 128: `SIGNED_OFFSETS`) and each sum starts from -c·Σxq, the sum of the
activations it multiplies (a row's two half-block sums, computed once a pass: `half_sums`):
the same exact integers, with no column term to store and no shifted copy of the activations.
Q8_1's weights (Q5_1's and Q5_K's q, 0..31, with a min as Q4_1's) are re-laid as Q4_1's
nibbles and a fifth vector of their fifth bits (5 bits a weight, not 8); four of their product
pairs (≤ 4·2·31·127) are summed in int16. Q5_0's weights (`gguf_blocks` widens them to Q8_0's
int8, all in [-16, 15]) are re-laid the same way as w + 16 (kind "Q5_0"), each sum starting
from -16·Σxq on both instruction sets: 0.75 bytes a weight where int8 took 1.125; Q4_0's
(`gguf_blocks`: Q4_1's with m = -8d) as nibbles w + 8 the same way (kind "Q4_0"), with no min.

A K-quant's scales and mins are a float16 d (dmin) a super-block of 256 weights times a 6-bit
integer a block of 32 (`gguf_blocks`: the float layouts widen them to a float32 a block). Here
they stay that compact (kinds "Q4_K" and "Q5_K", `FACTORED`): a float32 a super-block and a
byte a block and column (`_factored_scales`), which the kernel multiplies back, exactly, before
it uses them: the bits of a float32 a block, at 0.09 bytes a weight instead of 0.25. Scales
and mins that are all float16 (the other types' own, and Q6_K's and Q3_K's d) are kept in two
bytes, widened exactly as they are loaded (`Int8Tiles.half_scales`).

A wide type (Q6_K: `service/kernels/gguf_blocks.py` makes its weights the exact int16
integers scale·(q - 32), |w| ≤ 4096, times the super-block's d) is re-laid as 6-bit weights
and an int8 scale a 16 (kind "Q6_K", `_scaled`): the file's 0.82 bytes a weight, with d a
super-block's; where every weight fits 4 bits so (Q3_K's, scale·(q - 4): `gguf_blocks`), as
4-bit ones (kind "Q3_K"). Each sub-block's sum is exact, then times its scale: on AVX2 by
the sign trick within int16, on VNNI from the stored bits w + 2^(bits-1) as Q8_0's, each half
block's sum starting from -2^(bits-1) times its activations' (|sums| < 2^31 either way).

The inner kernel is LLVM IR built here with llvmlite (numba's own compiler: nothing to
install) and compiled for this CPU at load: numba's vectorizer emits none of these instructions
from scalar code (an int16 pair-product loop stayed scalar, slower than the float kernel), so
the IR calls them itself. Weights are re-laid at load into tiles of one vector's int32 lanes of
output columns (16 on AVX-512, 8 on AVX2): per block of 32 inputs, four vectors, byte 4c+i of
vector g holding column c's weights 4g+i (low nibble) and 16+4g+i (high nibble). numba's threads
split the tiles.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import njit, prange

from service.kernels.native import compile_ir

BLOCK = 32  # inputs per block (Q4_1's, and the activations' scale)
RELAY_TILES = 64  # `int8_tiles` re-lays a weight this many of its 32-column tiles at a time
# Rows sharing each loaded (and unpacked) block, largest first, while a whole group is left
# (their accumulators and the block fit AVX-512's 32 registers; on AVX2's 16 some spill, and
# yet 4 measured faster than 2 or 1 from 4 rows on). Two and three rows get groups of their
# own: a 2- or 3-token tree then unpacks each block once, not once a row, where unpacking
# makes up much of a one-row pass (docs/benchmarks.md, "Tree costs"). Passes of 8 rows or
# more take `int8_chunk_kernel.py`, which groups 8.
ROW_GROUPS = (4, 3, 2, 1)


@dataclass(frozen=True)
class Isa:
    """A vector instruction set the kernels are built for."""

    name: str
    features: tuple[str, ...]  # what the CPU must have (LLVM's names)
    columns: int  # output columns of a tile: one vector of int32 / float32 lanes
    # The signed kinds' weights (Q8_0's, Q6_K's, Q3_K's) enter as w + c, unsigned (VNNI's
    # operand order), and each sum less c times the activations' (`SIGNED_OFFSETS`); without
    # it (AVX2) they take the sign trick.
    offset_weights: bool

    @property
    def vector_bytes(self) -> int:
        return 4 * self.columns

    def weight_vectors(self, kind: str) -> int:
        """A block's whole vectors of weights in a tile of `kind`: 32 a column, 4, 5 or 8 bits
        each (Q6_K: four vectors of low nibbles, two of high bits; Q3_K: the nibbles)."""
        sizes = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q8_1": 5, "Q5_0": 5, "Q6_K": 6, "Q3_K": 4}
        return sizes[FACTORED.get(kind, kind)]

    def weight_bytes(self, kind: str) -> int:
        """A block's weights in a tile of `kind`: its vectors, then for `SCALED_BITS` kinds the
        two sub-blocks' int8 scales, a byte a column each."""
        scales = 2 * self.columns if kind in SCALED_BITS else 0
        return self.vector_bytes * self.weight_vectors(kind) + scales

    def block_bytes(self, kind: str) -> int:
        """A block of a tile of `kind`: its weights, then for `FACTORED` kinds a byte a column
        of the block's scale factor and one of its min factor."""
        return self.weight_bytes(kind) + (2 * self.columns if kind in FACTORED else 0)


VNNI = Isa("AVX-512 VNNI", ("avx512f", "avx512bw", "avx512vnni"), 16, True)
AVX2 = Isa("AVX2", ("avx2", "fma"), 8, False)
ISAS = (VNNI, AVX2)  # the first the CPU has is used


def supported_isas() -> tuple[Isa, ...]:
    """The instruction sets of `ISAS` this CPU has, best first."""
    try:
        import llvmlite.binding as llvm
    except ImportError:  # pragma: no cover - numba always brings llvmlite
        return ()
    features = llvm.get_host_cpu_features()
    return tuple(isa for isa in ISAS if all(features.get(f, False) for f in isa.features))


@functools.cache
def best_isa() -> Isa | None:
    """The instruction set the kernels use on this CPU, or None (the 8-bit path is refused)."""
    isas = supported_isas()
    return isas[0] if isas else None


def int8_supported() -> bool:
    """Whether this CPU has the instructions of one of `ISAS`."""
    return best_isa() is not None


REQUIRED_FEATURES = " or ".join(" + ".join(isa.features) for isa in ISAS)  # for error messages


@dataclass(frozen=True)
class Int8Tiles:
    """A weight [out_features, in_features] re-laid for the kernel of `isa`."""

    # "Q4_1", "Q8_0", "Q8_1", their factored kinds "Q4_K" and "Q5_K" (`FACTORED`), "Q5_0"
    # (int8 weights of 5 bits), or for int16 weights "Q6_K" or "Q3_K"
    kind: str
    isa: Isa
    # [U, B, `Isa.block_bytes`] uint8: tile u, block b (module docstring)
    packed: np.ndarray
    # float32 scales of the tile's columns (or float16's bits, `half_scales`): [U, B, columns],
    # or a super-block's [U, B/8, columns] (`PER_SUPER_BLOCK`: the factored and int16 kinds)
    d: np.ndarray
    # Q4_1, Q8_1: [U, B, columns] float32 mins; Q4_K, Q5_K: a super-block's [U, B/8, columns];
    # the others: none ([U, 0, columns])
    m: np.ndarray
    out_features: int
    in_features: int

    @property
    def padded_features(self) -> int:
        """The output columns the kernel writes: whole tiles."""
        return self.packed.shape[0] * self.isa.columns

    @property
    def half_scales(self) -> bool:
        """Whether d and m are float16, held as their bits (uint16: numba has no float16
        arrays), where every value is one (`int8_tiles`)."""
        return self.d.dtype == np.uint16

    def rows(self, first: int, count: int) -> Int8Tiles:
        """Output rows first..first+count-1 (`first` a whole number of tiles in), as views."""
        assert first % self.isa.columns == 0
        tiles = slice(first // self.isa.columns, -(-(first + count) // self.isa.columns))
        return replace(
            self,
            packed=self.packed[tiles],
            d=self.d[tiles],
            m=self.m[tiles],
            out_features=count,
        )

    def dequantized(self) -> np.ndarray:
        """The float32 weights [out_features, in_features] the kernels compute with (w = d·q,
        plus m for `FLOAT_MINS`), read back from the re-laid bytes: tests check them against
        the file's."""
        units, blocks, _ = self.packed.shape
        lanes = self.isa.columns
        vectors = self.isa.vector_bytes * self.isa.weight_vectors(self.kind)
        weights = self.packed[:, :, :vectors].reshape(units, blocks, -1, lanes, 4)
        kind = FACTORED.get(self.kind, self.kind)
        q = _weights(kind, weights)  # [U,B,c,32]
        if kind in SCALED_BITS:  # times each sub-block's scale
            scales = self.packed[:, :, vectors : self.isa.weight_bytes(kind)].view(np.int8)
            scales = scales.reshape(units, blocks, 2, lanes).transpose(0, 1, 3, 2)  # [U,B,c,2]
            q = np.repeat(scales.astype(np.int32), 16, axis=3) * q
        offset = weight_offset(self.kind, self.isa)
        if offset and kind not in SCALED_BITS:  # stored as the bytes w + c
            q = q.astype(np.uint8).astype(np.int32) - offset
        d, m = self.block_scales()
        w = d[..., None] * q.astype(np.float32)
        if self.kind in FLOAT_MINS:
            w = w + m[..., None]
        w = w.transpose(0, 2, 1, 3).reshape(units * lanes, blocks * BLOCK)
        return np.ascontiguousarray(w[: self.out_features])

    def block_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """Each block's d and m [U, B, columns], as the kernel makes them: a factored kind's
        super-block float times the block's byte (exact), an int16 kind's super-block d."""
        d, m = (
            (a.view(np.float16).astype(np.float32) for a in (self.d, self.m))
            if self.half_scales
            else (self.d, self.m)
        )
        if self.kind in PER_SUPER_BLOCK:
            d = np.repeat(d, SUPER_BLOCKS, axis=1)
        if self.kind in FACTORED:
            lanes, at = self.isa.columns, self.isa.weight_bytes(self.kind)
            factors = self.packed[:, :, at : at + 2 * lanes].astype(np.float32)
            d = d * factors[:, :, :lanes]
            m = np.repeat(m, SUPER_BLOCKS, axis=1) * factors[:, :, lanes:]
        return d, m


def _weights(kind: str, vectors: np.ndarray) -> np.ndarray:
    """The integer weights [U, B, c, 32] (for `SCALED_BITS` before their scale a 16) of a
    block's re-laid vectors [U, B, v, c, 4] of `kind` (the inverse of `_relaid`)."""

    def nibbles(v: np.ndarray) -> np.ndarray:  # [U, B, 4, c, 4] -> [U, B, c, 32]: 16h + 4g + i
        halves = np.stack([v & 15, v >> 4], axis=2).astype(np.int32)  # [U, B, h, g, c, i]
        return halves.transpose(0, 1, 4, 2, 3, 5).reshape(*v.shape[:2], v.shape[3], BLOCK)

    def by_input(v: np.ndarray) -> np.ndarray:  # [U, B, g, c, i] -> [U, B, c, g*i]
        return v.transpose(0, 1, 3, 2, 4).reshape(*v.shape[:2], v.shape[3], -1).astype(np.int32)

    if kind == "Q8_0":
        return by_input(vectors.view(np.int8))
    q = nibbles(vectors[:, :, :4])
    if kind in NIBBLES:
        return q
    if kind in FIVE_BITS:  # bit 4h + g of the fifth vector: weight 16h + 4g + i's fifth bit
        fifth = vectors[:, :, 4].astype(np.int32)  # [U, B, c, i]
        bits = np.stack([(fifth >> (4 * h + g)) & 1 for h in (0, 1) for g in range(4)], axis=2)
        return q | (
            bits.reshape(*fifth.shape[:2], 2, 4, fifth.shape[2], 4)
            .transpose(0, 1, 4, 2, 3, 5)
            .reshape(q.shape)
            << 4
        )
    bits = SCALED_BITS[kind]  # low nibbles, for 6 bits two vectors of high bits
    if bits > 4:
        high = vectors[:, :, 4:6].astype(np.int32)  # [U, B, h, c, i]: bits 2g, 2g+1
        top = np.stack([(high >> (2 * g)) & 3 for g in range(4)], axis=3)  # [U, B, h, g, c, i]
        q = q | (top.transpose(0, 1, 4, 2, 3, 5).reshape(q.shape) << 4)
    return q - 2 ** (bits - 1)


def int8_tiles(
    kind: str,
    qs: np.ndarray,
    d: np.ndarray,
    m: np.ndarray,
    out_features: int,
    isa: Isa | None = None,
) -> Int8Tiles:
    """Re-lay `PackedTiles`' arrays into the tiles of `isa`'s kernel (this CPU's best by
    default): Q4_1 qs [T, B, 16, 32] (byte j of a block: low nibble weight j, high nibble
    weight j+16), Q8_0 qs [T, B, 32, 32] int8, or int16 for a wide type (Q6_K, Q3_K); d, m
    [T, B, 32]. A few
    tiles at a time, so that the re-laying's temporaries stay small beside a large weight (a
    128k-row head's would take gigabytes)."""
    isa = isa or _required_isa()
    if kind == "Q4_1" and np.array_equal(m, -8 * d):  # a Q4_0 file's (`gguf_blocks`)
        kind = "Q4_0"
    if kind == "Q8_0" and qs.dtype == np.int16:
        kind = _scaled_kind(qs)
    elif kind == "Q8_0" and all(
        _fits_5_bits(qs[at : at + RELAY_TILES]) for at in range(0, qs.shape[0], RELAY_TILES)
    ):
        kind = "Q5_0"  # (a Q5_0 file's, re-laid as Q8_0 by `gguf_blocks`)
    starts = range(0, qs.shape[0], RELAY_TILES)
    factors: list[tuple[Factored, Factored] | None] = [None] * len(starts)
    if kind in FLOAT_MINS:  # a K-quant's scales and mins: a float a super-block, a byte a block
        scales = [_factored_scales(d[at : at + RELAY_TILES]) for at in starts]
        mins = [_factored_scales(m[at : at + RELAY_TILES]) for at in starts]
        if all(f is not None for f in scales + mins):
            kind = next(name for name, base in FACTORED.items() if base == kind)
            factors = list(zip(scales, mins))  # type: ignore[arg-type]
    parts = [
        _relaid(kind, qs[at : at + RELAY_TILES], d[at : at + RELAY_TILES], m, at, isa, f)
        for at, f in zip(starts, factors)
    ]
    packed, scales, mins = (np.concatenate([part[i] for part in parts]) for i in (1, 2, 3))
    if _half_exact(scales) and _half_exact(mins):  # the file's float16 scales: half the bytes
        scales, mins = (a.astype(np.float16).view(np.uint16) for a in (scales, mins))
    return Int8Tiles(parts[0][0], isa, packed, scales, mins, out_features, qs.shape[1] * BLOCK)


def _half_exact(a: np.ndarray) -> bool:
    """Whether every value of float32 `a` is a float16 (a file's scales, and Q4_0's -8·d)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def _relaid(
    kind: str,
    qs: np.ndarray,
    d: np.ndarray,
    m: np.ndarray,
    at: int,
    isa: Isa,
    factors: tuple[Factored, Factored] | None = None,
) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """`int8_tiles` of the tiles from `at` on (`qs` and `d` are theirs, `m` the whole weight's;
    `factors`: a factored kind's scales and mins, `_factored_scales`): their kind, packed
    bytes, d and m."""
    tiles, blocks, _, width = qs.shape
    lanes = isa.columns

    def columns(a: np.ndarray, dtype: type) -> np.ndarray:  # [T, b, width] -> [U, b, lanes]
        a = a.transpose(0, 2, 1).reshape(-1, lanes, a.shape[1])
        return np.ascontiguousarray(a.transpose(0, 2, 1), dtype=dtype)

    no_mins = np.zeros((-(-tiles * width // lanes), 0, lanes), np.float32)
    if kind in SCALED_BITS:  # stored as w + 2^(bits-1): `SIGNED_OFFSETS`
        scaled = _scaled(qs, lanes, SCALED_BITS[kind])
        supers = d.reshape(tiles, -1, SUPER_BLOCKS, width)
        assert (supers == supers[:, :, :1]).all(), "an int16 kind's d is its super-block's"
        return kind, scaled, columns(supers[:, :, 0], np.float32), no_mins
    if kind == "Q8_0":  # int8, or w + 128 as a byte for `Isa.offset_weights`
        q = qs.transpose(0, 3, 1, 2).reshape(-1, lanes, blocks, 8, 4)  # [U, c, B, g, i]
        q = q.view(np.uint8) ^ np.uint8(0x80) if isa.offset_weights else q
        m = no_mins
    else:  # Q4_1, Q8_1, Q5_0: nibbles, and the fifth bits (bit 4h + g: weight 16h + 4g + i's)
        # [T, B, 32 inputs, width columns] -> [U, c, B, half, g, i]
        base = FACTORED.get(kind, kind)
        if base in NIBBLES:
            q = np.concatenate([qs & 15, qs >> 4], axis=2)
        else:  # Q5_0's w + 16 (0..31), as Q8_1's q
            q = (qs + np.int8(weight_offset(kind, isa))).view(np.uint8)
        q = q.transpose(0, 3, 1, 2).reshape(-1, lanes, blocks, 2, 4, 4)
        nibbles = (q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)  # [U, c, B, g, i]
        if base in FIVE_BITS:
            fifth = sum((q[:, :, :, h, g] >> 4) << (4 * h + g) for h in (0, 1) for g in range(4))
            nibbles = np.concatenate([nibbles, fifth[:, :, :, None]], axis=3)  # [U, c, B, 5, i]
        q = nibbles
        m = m[at : at + tiles] if kind in FLOAT_MINS else no_mins
    packed = np.ascontiguousarray(  # [U, B, g, c, i]
        q.transpose(0, 2, 3, 1, 4).reshape(-1, blocks, isa.weight_bytes(kind) // q.itemsize)
    ).view(np.uint8)
    if factors is None:
        return kind, packed, columns(d, np.float32), columns(m, np.float32) if m.size else m
    (d_super, d_bytes), (m_super, m_bytes) = factors  # after the weights: the bytes a column
    packed = np.concatenate([packed, columns(d_bytes, np.uint8), columns(m_bytes, np.uint8)], 2)
    return kind, packed, columns(d_super, np.float32), columns(m_super, np.float32)


# A scale factored: a float32 a super-block [T, B/8, width] and a byte a block [T, B, width]
Factored = tuple[np.ndarray, np.ndarray]


def _factored_scales(a: np.ndarray) -> Factored | None:
    """Float32 block scales (or mins) [T, B, width] as a float32 s a super-block of
    `SUPER_BLOCKS` blocks and a byte f a block with s·f each block's value exactly, or None
    where some super-block's do not factor so. A K-quant's always do (d·sc, -(dmin·mn): a
    float16 times a 6-bit integer); s is the values' greatest common divisor, which any such
    factoring's products equal. The values are taken as integers times a power of two (their
    24-bit significands shifted to the super-block's least exponent)."""
    tiles, blocks, width = a.shape
    if blocks % SUPER_BLOCKS:
        return None
    v = a.reshape(tiles, blocks // SUPER_BLOCKS, SUPER_BLOCKS, width)
    negative = (v < 0).any(axis=2)
    if ((v > 0).any(axis=2) & negative).any():  # a super-block of mixed signs
        return None
    significand, exponent = np.frexp(np.abs(v))
    n = (significand * np.float32(2**24)).astype(np.int64)  # exact: 24 bits
    e = exponent.astype(np.int64) - 24
    nonzero = n > 0
    low = np.where(nonzero, e, np.iinfo(np.int64).max).min(axis=2, keepdims=True)
    shift = np.where(nonzero, e - low, 0)
    if shift.max(initial=0) > 38:  # beyond int64 (n < 2^24); no byte factors reach that far
        return None
    n <<= shift
    g = np.gcd.reduce(n, axis=2, keepdims=True)
    factors = n // np.maximum(g, 1)
    if factors.max(initial=0) > 255:
        return None
    s = np.ldexp(g.astype(np.float64), np.where(g > 0, low, 0))[:, :, 0]
    s = np.where(negative, -s, s).astype(np.float32)
    factors = factors.astype(np.uint8)
    if not (s[:, :, None] * factors.astype(np.float32) == v).all():  # e.g. s out of float32
        return None
    return s, factors.reshape(tiles, blocks, width)


# blocks a K-quant's super-block (256 weights)
SUPER_BLOCKS = 8
# the kinds whose block scales and mins are a float32 a super-block times a byte a block
# (K-quants': `_factored_scales`), and the kinds of their weights. The file's compact scales
# then cost the kernel 0.09 bytes a weight, where a float32 d and m a block cost 0.25.
FACTORED = {"Q4_K": "Q4_1", "Q5_K": "Q8_1"}
# the kinds whose weights are unsigned with a float min a block (w = d·q + m)
FLOAT_MINS = ("Q4_1", "Q8_1", *FACTORED)
# the kinds of int16 weights re-laid on AVX2 as a few bits times a scale a 16, and their bits
SCALED_BITS = {"Q6_K": 6, "Q3_K": 4}
# the kinds whose d is a super-block's (`Int8Tiles.d`)
PER_SUPER_BLOCK = (*FACTORED, *SCALED_BITS)
# the signed kinds, and c: their weights as bytes w + c, for `Isa.offset_weights`
SIGNED_OFFSETS = {"Q8_0": 128, **{kind: 2 ** (bits - 1) for kind, bits in SCALED_BITS.items()}}
# the kinds of 4-bit weights (nibbles): Q4_1's q, Q4_0's w + 8
NIBBLES = ("Q4_1", "Q4_0")
# the kinds of 5-bit weights (nibbles and a vector of fifth bits): Q8_1's q, Q5_0's w + 16
FIVE_BITS = ("Q8_1", "Q5_0")
# the kinds stored as w + c on every instruction set (their w + c fits their bits), and c
UNSIGNED_OFFSETS = {"Q4_0": 8, "Q5_0": 16}


def weight_offset(kind: str, isa: Isa) -> int:
    """c where `kind`'s weights are stored as w + c, each sum then starting from -c·Σxq:
    `UNSIGNED_OFFSETS` everywhere, the signed kinds' for `Isa.offset_weights`; else 0."""
    if kind in UNSIGNED_OFFSETS:
        return UNSIGNED_OFFSETS[kind]
    return SIGNED_OFFSETS.get(kind, 0) if isa.offset_weights else 0


def _fits_5_bits(qs: np.ndarray) -> bool:
    """Whether int8 weights are all in [-16, 15] (a Q5_0 file's are: kind "Q5_0")."""
    return qs.dtype == np.int8 and qs.size > 0 and qs.min() >= -16 and qs.max() <= 15


def _scaled_kind(qs: np.ndarray) -> str:
    """How the kernels take int16 weights: "Q3_K" where every sub-block factors into 4-bit
    weights (a Q3_K file's always do), else "Q6_K" (6 bits: a Q6_K file's always do). Tile by
    tile, as the re-laying goes; a Q6_K weight stops at its first tiles."""
    for at in range(0, qs.shape[0], RELAY_TILES):
        if _factored(qs[at : at + RELAY_TILES], 4) is None:
            return "Q6_K"
    return "Q3_K"


def _factored(qs: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Int16 weights [T, B, 32, width] as a scale s [T, B, 2, width] a 16, an int8, and w [T,
    B, 2, 16, width] in [-2^(bits-1), 2^(bits-1)) with s·w the weight, or None where they do
    not fit. Any such factoring gives the same products, hence the same sums. s is the 16
    products' greatest common divisor G, signed so that w fits where it can; where G does not
    fit a byte, G divided by the least k that leaves w·k in range (`_byte_scales`)."""
    tiles, blocks, _, width = qs.shape
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    products = qs.astype(np.int32).reshape(tiles, blocks, 2, 16, width)
    g = np.gcd.reduce(np.abs(products), axis=3)  # [T, B, 2, width]
    g[g == 0] = 1
    w = products // g[:, :, :, None]
    flip = w.max(axis=3) > high
    w = np.where(flip[:, :, :, None], -w, w)
    if w.min() < low or w.max() > high:  # then no smaller scale fits either
        return None
    s = np.where(flip, -g, g)
    wide = np.nonzero((s < -128) | (s > 127))  # (a Q6_K's scale times common factors)
    if wide[0].size:
        narrowed = _byte_scales(s[wide], w[wide[0], wide[1], wide[2], :, wide[3]], low, high)
        if narrowed is None:
            return None
        s[wide], w[wide[0], wide[1], wide[2], :, wide[3]] = narrowed
    return s, w


def _byte_scales(
    g: np.ndarray, w: np.ndarray, low: int, high: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Sub-blocks' scales g [n] (past a byte) and weights w [n, 16] in [low, high] as g / k and
    w·k for the least k that fits both (a Q6_K or Q3_K file's own factoring, its int8 scale
    times q - 32 or q - 4, is one), or None where none does."""
    s, narrowed = np.zeros_like(g), np.empty_like(w)
    left = np.arange(len(g))
    for k in range(1, high - low + 1):
        for sign in (1, -1):
            scaled, scale = sign * k * w[left], sign * (g[left] // k)
            fits = (
                (g[left] % k == 0)
                & (scale >= -128)
                & (scale <= 127)
                & (scaled.min(axis=1) >= low)
                & (scaled.max(axis=1) <= high)
            )
            s[left[fits]], narrowed[left[fits]] = scale[fits], scaled[fits]
            left = left[~fits]
        if not left.size:
            return s, narrowed
    return None


def _scaled(qs: np.ndarray, lanes: int, bits: int) -> np.ndarray:
    """Int16 weights (`gguf_blocks`: Q6_K's scale·(q - 32), Q3_K's scale·(q - 4), a scale a 16
    weights) as the kind of `bits` (`SCALED_BITS`): per 16 weights an int8 scale s and w
    (`_factored`), stored as w + 2^(bits-1). A block's bytes: four vectors of the low nibbles
    (as Q4_1's), for 6 bits two of the high bits (vector h, byte 4c+i: bits 2g, 2g+1 hold
    weight 16h+4g+i's), then one of the two sub-blocks' scales."""
    tiles, blocks, _, width = qs.shape
    factored = _factored(qs, bits)
    assert factored is not None
    s, w = factored
    stored = (w + 2 ** (bits - 1)).astype(np.uint8).reshape(tiles, blocks, 32, width)
    # [T, B, 32, width] -> [U, c, B, half, g, i]: input 16 half + 4 g + i of column c
    by_input = stored.transpose(0, 3, 1, 2).reshape(-1, lanes, blocks, 2, 4, 4)
    low = (by_input[:, :, :, 0] & 15) | ((by_input[:, :, :, 1] & 15) << 4)  # [U, c, B, g, i]
    parts = [low.transpose(0, 2, 3, 1, 4).reshape(-1, blocks, 16 * lanes)]
    if bits > 4:
        top = by_input >> 4
        high = sum(top[:, :, :, :, g] << (2 * g) for g in range(4)).astype(np.uint8)  # [U,c,B,h,i]
        parts.append(high.transpose(0, 2, 3, 1, 4).reshape(-1, blocks, 8 * lanes))
    scales = s.astype(np.int8).transpose(0, 3, 1, 2).reshape(-1, lanes, blocks, 2)
    parts.append(
        np.ascontiguousarray(scales.transpose(0, 2, 3, 1))
        .reshape(-1, blocks, 2 * lanes)
        .view(np.uint8)
    )
    return np.concatenate(parts, axis=2)


def _required_isa() -> Isa:
    isa = best_isa()
    if isa is None:
        raise RuntimeError(f"--quantization gguf-int8 needs a CPU with {REQUIRED_FEATURES}")
    return isa


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


@njit(cache=True, nogil=True)
def half_sums(xq, out):  # pragma: no cover - compiled
    """Per row and block of 32 of xq [R, K], the sums of its two halves of 16 as one int32
    (the first in the low 16 bits, both signed: |sum| <= 16·127) in out [R, K/32]."""
    rows, width = xq.shape
    for r in range(rows):
        for b in range(width // BLOCK):
            low = 0
            high = 0
            for j in range(BLOCK // 2):
                low += xq[r, b * BLOCK + j]
                high += xq[r, b * BLOCK + BLOCK // 2 + j]
            out[r, b] = (low & 0xFFFF) | (high << 16)


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


def _ir(
    kind: str,
    isa: Isa,
    row_groups: Sequence[int] = ROW_GROUPS,
    addresses: Addresses = row_major,
    half: bool = False,
) -> str:
    """The tile kernel's LLVM IR for `isa`: tiles(packed, d, m, xq, dx, xs, out, rows, blocks,
    out_stride, count) computes out[r, Cu : Cu + C] (C = `isa.columns`) for the `count` tiles
    from `packed`. Q4_1 (and Q8_1, bytes): weights (nibbles, unsigned) times xq (signed), plus
    m·xs; Q8_0 on VNNI: xq + 128 (unsigned) times the weights (signed), the sums starting from
    m = -128·Σ w; on AVX2: |w| times xq with w's sign; Q6_K and Q3_K the same way a sub-block
    at a time, each sub-block's sum times its scale. Rows go `row_groups` at a time through
    each block (the largest first, while a whole group is left), so a block's weights are
    loaded (and unpacked) once for the group; every row's arithmetic is the same in a group as
    alone. `addresses` says where a row's inputs are (`row_major` by default; see
    `service/kernels/int8_chunk_kernel.py` for the other layout)."""
    from llvmlite import ir

    i8, i16, i32, i64 = (ir.IntType(n) for n in (8, 16, 32, 64))
    f32 = ir.FloatType()
    lanes = isa.columns
    vector = ir.VectorType(i8, isa.vector_bytes)
    ints, floats = ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
    shorts = ir.VectorType(i16, 2 * lanes)
    module = ir.Module(name="ngrammys_int8")

    def intrinsic(name: str, result: Any, *operands: Any) -> Any:
        return ir.Function(module, ir.FunctionType(result, list(operands)), name=name)

    fma = intrinsic(f"llvm.fma.v{lanes}f32", floats, floats, floats, floats)
    if isa.name == VNNI.name:
        dpbusd = intrinsic("llvm.x86.avx512.vpdpbusd.512", ints, ints, vector, vector)
    else:
        maddubs = intrinsic("llvm.x86.avx2.pmadd.ub.sw", shorts, vector, vector)
        madd = intrinsic("llvm.x86.avx2.pmadd.wd", ints, shorts, shorts)
        sign = intrinsic("llvm.x86.avx2.psign.b", vector, vector, vector)
        ones = ir.Constant(shorts, [1] * 2 * lanes)
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
    block_bytes, weight_bytes = isa.block_bytes(kind), isa.weight_bytes(kind)
    factored, base = kind in FACTORED, FACTORED.get(kind, kind)
    start, tile_head = function.append_basic_block("start"), function.append_basic_block("tile")
    ir.IRBuilder(start).branch(tile_head)

    def super_block(b: Any, block: Any) -> Any:  # a block's super-block
        return b.udiv(block, const(SUPER_BLOCKS))

    b = ir.IRBuilder(tile_head)
    tile = b.phi(i64, "tile")
    tile.add_incoming(const(0), start)
    packed = b.gep(packed0, [b.mul(tile, b.mul(blocks, const(block_bytes)))])
    d_rows = super_block(b, blocks) if kind in PER_SUPER_BLOCK else blocks
    # d and m: float32, or float16 (`half`, widened exactly as they are loaded)
    scale_type = ir.HalfType() if half else f32
    scale_vector = ir.VectorType(scale_type, lanes)
    d = b.gep(b.bitcast(d0, scale_type.as_pointer()), [b.mul(tile, b.mul(d_rows, const(lanes)))])
    m = b.gep(
        b.bitcast(m0, scale_type.as_pointer()),
        [b.mul(tile, b.mul(d_rows if factored else blocks, const(lanes)))],
    )
    # the signed kinds' weights offset (`Isa.offset_weights`): c, and each sum less c·Σxq
    offset = weight_offset(kind, isa)
    nibbled = base in NIBBLES or base in FIVE_BITS  # weights as nibbles (and fifth bits)
    out = b.gep(out0, [b.mul(tile, const(lanes))])

    def dot(b: Any, sums: Any, products: list[tuple[Any, Any]]) -> Any:
        """sums + Σ over (weights, inputs) pairs of their lanes' products, four bytes a lane."""
        if isa.name == VNNI.name:
            for weight, inputs in products:  # unsigned weights (`offset`) first
                sums = b.call(dpbusd, [sums, weight, inputs])
            return sums
        if nibbled:  # unsigned weights: Q4_1's ≤ 15 (module docstring), 5 bits' ≤ 31
            pairs = [b.call(maddubs, [weight, inputs]) for weight, inputs in products]
        elif kind in SCALED_BITS:  # a sub-block's: |w| ≤ 32, so four pairs ≤ 4·2·32·127 < 2^15
            pairs = [
                b.call(maddubs, [b.call(sign, [weight, weight]), b.call(sign, [inputs, weight])])
                for weight, inputs in products
            ]
        if nibbled or kind in SCALED_BITS:
            run = 4 if base in FIVE_BITS else len(pairs)  # pairs summed in int16 before widening
            for at in range(0, len(pairs), run):
                total = pairs[at]
                for pair in pairs[at + 1 : at + run]:
                    total = b.add(total, pair)
                sums = b.add(sums, b.call(madd, [total, ones]))
            return sums
        for weight, inputs in products:  # |w| times xq·sign(w): within int16 pair by pair
            magnitude = b.call(sign, [weight, weight])
            pair = b.call(maddubs, [magnitude, b.call(sign, [inputs, weight])])
            sums = b.add(sums, b.call(madd, [pair, ones]))
        return sums

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
            total.add_incoming(ir.Constant(floats, [0.0] * lanes), head)
        weights = b.gep(packed, [b.mul(block, const(block_bytes))])
        scale_row = super_block(b, block) if kind in PER_SUPER_BLOCK else block

        def scales_at(array: Any, at: Any) -> Any:  # a block's lanes of d or m, as float32
            pointer = b.bitcast(b.gep(array, [b.mul(at, const(lanes))]), scale_vector.as_pointer())
            loaded = b.load(pointer, align=2)
            return b.fpext(loaded, floats) if half else loaded

        scales = scales_at(d, scale_row)
        column_terms = (
            scales_at(m, scale_row if factored else block) if kind in FLOAT_MINS else None
        )
        if factored:  # the block's factors (bytes after its weights) times the super-block's
            factor_bytes = ir.VectorType(i8, lanes)

            def factor(at: int) -> Any:
                pointer = b.bitcast(b.gep(weights, [const(at)]), factor_bytes.as_pointer())
                return b.uitofp(b.zext(b.load(pointer, align=1), ints), floats)

            scales = b.fmul(scales, factor(weight_bytes))  # exact (`_factored_scales`)
            column_terms = b.fmul(column_terms, factor(weight_bytes + lanes))

        def splat(pointer: Any) -> Any:
            first = b.insert_element(
                ir.Constant(floats, None), b.load(pointer), ir.Constant(i32, 0)
            )
            return b.shuffle_vector(
                first, ir.Constant(floats, None), ir.Constant(ints, [0] * lanes)
            )

        def splat_int(value: Any) -> Any:
            first = b.insert_element(ir.Constant(ints, None), value, ir.Constant(i32, 0))
            return b.shuffle_vector(first, ir.Constant(ints, None), ir.Constant(ints, [0] * lanes))

        vectors = [
            b.load(
                b.bitcast(b.gep(weights, [const(isa.vector_bytes * g)]), vector.as_pointer()),
                align=1,
            )
            for g in range(isa.weight_vectors(kind))
        ]
        filled = lambda value: ir.Constant(vector, [value] * isa.vector_bytes)  # noqa: E731
        if nibbled:  # (weights, input offset) pairs: low nibbles 4g.., high 16+4g..
            nibbles = vectors[:4]
            operands = [(b.and_(v, filled(15)), 4 * g) for g, v in enumerate(nibbles)]
            operands += [
                (b.and_(b.lshr(v, filled(4)), filled(15)), BLOCK // 2 + 4 * g)
                for g, v in enumerate(nibbles)
            ]
            if base in FIVE_BITS:  # pair k's fifth bits: bit k of the fifth vector, to bit 4

                def fifth(k: int) -> Any:
                    v = vectors[4]
                    moved = b.shl(v, filled(4 - k)) if k < 4 else b.lshr(v, filled(k - 4))
                    return b.and_(moved if k != 4 else v, filled(16))

                operands = [(b.or_(w, fifth(k)), at) for k, (w, at) in enumerate(operands)]
        elif kind in SCALED_BITS:  # (w, input offset) pairs: the bits (w + 2^(bits-1)), or w
            six = SCALED_BITS[kind] == 6

            def bits_of(half: int, g: int, v: Any) -> Any:
                nibble = b.and_(b.lshr(v, filled(4 * half)), filled(15))
                if not six:
                    return nibble
                high = b.and_(b.lshr(vectors[4 + half], filled(2 * g)), filled(3))
                return b.or_(nibble, b.shl(high, filled(4)))

            signed = not offset  # the sign trick takes w itself
            operands = [
                (
                    b.sub(bits_of(half, g, v), filled(SIGNED_OFFSETS[kind]))
                    if signed
                    else bits_of(half, g, v),
                    16 * half + 4 * g,
                )
                for half in (0, 1)
                for g, v in enumerate(vectors[:4])
            ]
            scale_bytes = ir.VectorType(i8, 2 * lanes)  # after the vectors: an int8 a column
            at = const(isa.vector_bytes * isa.weight_vectors(kind))
            packed_scales = b.load(
                b.bitcast(b.gep(weights, [at]), scale_bytes.as_pointer()), align=1
            )
            sub_scales = [
                b.sext(
                    b.shuffle_vector(
                        packed_scales,
                        ir.Constant(scale_bytes, None),
                        ir.Constant(ints, list(range(h * lanes, (h + 1) * lanes))),
                    ),
                    ints,
                )
                for h in (0, 1)
            ]
        else:  # four int8 weights a lane (or w + 128)
            operands = [(v, 4 * g) for g, v in enumerate(vectors)]
        news = []
        for r, total in enumerate(totals):
            inputs, row_dx, row_xs = addresses(b, (xq, dx, xs, blocks), row, r, block)
            products = []
            for weight, at in operands:  # xq[at : at + 4] in every 32-bit lane
                word = b.load(b.bitcast(b.gep(inputs, [const(at)]), i32.as_pointer()), align=1)
                first = b.insert_element(ir.Constant(ints, None), word, ir.Constant(i32, 0))
                splatted = b.shuffle_vector(
                    first, ir.Constant(ints, None), ir.Constant(ints, [0] * lanes)
                )
                products.append((weight, b.bitcast(splatted, vector)))
            # where each sum starts: 0, or for offset weights -c·Σxq of its half blocks (the
            # row's two int16 sums, `half_sums`, in place of dx·Σxq)
            starts = [ir.Constant(ints, [0] * lanes)] * 2
            if offset:
                halves = b.load(b.bitcast(row_xs, i32.as_pointer()), align=4)
                low = b.sext(b.trunc(halves, i16), i32)
                high = b.ashr(halves, ir.Constant(i32, 16))
                starts = [splat_int(b.mul(half, ir.Constant(i32, -offset))) for half in (low, high)]
            if kind in SCALED_BITS:  # each sub-block's exact sum times its scale
                sums = b.add(
                    b.mul(dot(b, starts[0], products[:4]), sub_scales[0]),
                    b.mul(dot(b, starts[1], products[4:]), sub_scales[1]),
                )
            else:
                start = starts[0] if not offset else b.add(starts[0], starts[1])
                sums = dot(b, start, products)
            new = b.call(fma, [b.sitofp(sums, floats), b.fmul(scales, splat(row_dx)), total])
            if kind in FLOAT_MINS:
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


def int8_matmul(kind: str = "Q4_1", isa: Isa | None = None, half: bool = False) -> Any:
    """`int8_matmul(kind, isa, half)(x, packed, d, m, out, chunks)`: out[R, C·U] = x[R, K] @
    W.T for the weight of (packed, d, m) (`Int8Tiles` of that kind and instruction set, this
    CPU's best by default; `half`: its d and m float16, `Int8Tiles.half_scales`), x quantized
    per row and block first; the tiles split into `chunks` parts over numba's threads (0 or 1:
    the calling thread)."""
    return _int8_matmul(kind, isa or _required_isa(), half)


def matmul_of(tiles: Int8Tiles) -> Any:
    """`int8_matmul` for `tiles`' kind, instruction set and scales."""
    return int8_matmul(tiles.kind, tiles.isa, tiles.half_scales)


@functools.cache
def _int8_matmul(kind: str, isa: Isa, half: bool) -> Any:
    tiles_kernel = compile_ir(_ir(kind, isa, half=half), "tiles", [ctypes.c_int64] * 11)
    # offset weights (`Isa.offset_weights`) take each row's half-block sums where dx·Σxq was
    halves = weight_offset(kind, isa) > 0

    @njit(nogil=True)
    def matmul(x, packed, d, m, out, chunks):  # pragma: no cover - compiled
        rows, width = x.shape
        blocks = width // BLOCK
        xq = np.empty((rows, width), np.int8)
        dx = np.empty((rows, blocks), np.float32)
        xs = np.empty((rows, blocks), np.float32)
        quantize_rows(x, xq, dx, xs)
        if halves:
            half_sums(xq, xs.view(np.int32))
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
                out[:, first * d.shape[2] :].ctypes.data,  # d: [U, B, columns]
                rows,
                blocks,
                out.shape[1],
                last - first,
            )


def warm_up(served: Iterable[Int8Tiles]) -> None:
    """Build and compile the kernels of the `served` tiles (their kinds, instruction sets and
    scales) now (LLVM, then numba, which cannot cache code that calls into this process's own
    machine code), not in the first request's pass, which would otherwise wait seconds for
    them. Each kernel takes about half a second: a model's own only."""
    x = np.zeros((1, BLOCK), np.float32)
    for kind, isa, half in sorted({(t.kind, t.isa, t.half_scales) for t in served}, key=str):
        scales = np.zeros((1, 1, isa.columns), np.uint16 if half else np.float32)
        int8_matmul(kind, isa, half)(
            x,
            np.zeros((1, 1, isa.block_bytes(kind)), np.uint8),
            scales,
            scales,
            np.empty((1, isa.columns), np.float32),
            0,
        )
