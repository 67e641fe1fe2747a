"""GGUF block types re-laid, exactly, into the packed kernels' four layouts.

The kernels (service/kernels/packed_kernels.py) compute with 32-weight groups in one of four
layouts: "Q4_1" (4-bit q in 0..15, a float32 scale d and min m a group: w = d*q + m, one
rounding), "Q8_0" (int8 q, a float32 scale d a group: w = d*q), "Q8_1" (int8 q, d and m:
w = d*q + m) and "Q8_1_16" (Q8_1 with a d and m for each half group). llama.cpp's block types
are those formulas with other bit packings and scales built from smaller fields:

| type | block | weight | layout |
|---|---|---|---|
| Q4_0 | 32: f16 d, 16 bytes of nibbles | d*(q-8) | Q4_1, m = -8d |
| Q4_1 | 32: f16 d, f16 m, nibbles | d*q + m | Q4_1 |
| Q2_K | 256: 16 4-bit scales and mins, 2-bit q, f16 d, f16 dmin | (d*sc)*q - dmin*mn | Q8_1_16 |
| Q3_K | 256: high bits, 2-bit lows, 16 6-bit scales, f16 d | (d*sc)*(q-4) | Q8_0, int16 sc*(q-4) |
| Q4_K | 256: f16 d, f16 dmin, 8 six-bit scales and mins, nibbles | (d*sc)*q - dmin*mn | Q4_1 |
| Q5_0 | 32: f16 d, 32 high bits, nibbles | d*(q-16) | Q8_0 |
| Q5_1 | 32: f16 d, f16 m, 32 high bits, nibbles | d*q + m | Q8_1 |
| Q5_K | 256: Q4_K's fields, then 32 bytes of high bits, nibbles | (d*sc)*q - dmin*mn | Q8_1 |
| Q6_K | 256: nibbles, 2-bit highs, 16 int8 scales, f16 d | (d*sc)*(q-32) | Q8_0, int16 sc*(q-32) |
| Q8_0 | 32: f16 d, 32 int8 | d*q | Q8_0 |

Each is exact: a float16 scale (11 significant bits) times a 6- or 8-bit scale or a 4- or 5-bit
q needs at most 21 bits, so every product but the last is exact in float32, and the kernels'
single rounding of d*q + m is the rounding gguf-py's dequantization makes (the loader checks
each packed weight against the loaded one, bit for bit). The layouts widen the types: Q4_K's
4.5 bits a weight to 6 (two float32 a group), Q5_0's 5.5 to 9, Q5_1's 6 and Q5_K's 5.5 to 10,
Q2_K's 2.6 to 12, Q3_K's 3.4 and Q6_K's 6.6 to 17: the price of four kernels for ten types.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # weights a kernel group
SUPER = 256  # weights a K-quant super-block


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type the kernels serve: its weights and bytes a block, and its layout."""

    weights: int
    nbytes: int
    layout: str  # "Q4_1", "Q8_0", "Q8_1" or "Q8_1_16"
    # q needs 16 bits (int16 in the 8-bit layout): kernels compiled for it on the first model
    # that has one; the 8-bit-activation kernels multiply it as int16 pairs, or on AVX2 as six
    # bits times a scale a 16 (`int8_kernel`)
    wide: bool = False


BLOCK_TYPES = {
    "Q2_K": BlockType(SUPER, 84, "Q8_1_16"),
    "Q4_0": BlockType(GROUP, 18, "Q4_1"),
    "Q4_1": BlockType(GROUP, 20, "Q4_1"),
    "Q3_K": BlockType(SUPER, 110, "Q8_0", wide=True),
    "Q4_K": BlockType(SUPER, 144, "Q4_1"),
    "Q5_0": BlockType(GROUP, 22, "Q8_0"),
    "Q5_1": BlockType(GROUP, 24, "Q8_1"),
    "Q5_K": BlockType(SUPER, 176, "Q8_1"),
    "Q6_K": BlockType(SUPER, 210, "Q8_0", wide=True),
    "Q8_0": BlockType(GROUP, 34, "Q8_0"),
}


@dataclass(frozen=True)
class Groups:
    """A weight [rows, K] as 32-weight groups: q [rows, K/32, 32] (uint8 0..15 for the Q4_1
    layout, int8 or int16 for Q8_0, int8 for Q8_1 and Q8_1_16), d and m [rows, K/32] float32
    (m all zero for Q8_0; [rows, K/32, 2] for Q8_1_16, a half group each)."""

    layout: str
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray


def unpack(kind: str, raw: np.ndarray, rows: int, columns: int) -> Groups:
    """`raw`: a `kind` weight's GGUF bytes [rows, columns / block weights * block bytes]
    (row-major blocks, as `gguf.GGUFReader` gives them) as the groups of its layout."""
    block = BLOCK_TYPES.get(kind)
    if block is None:
        raise ValueError(f"unsupported block type {kind}")
    if columns % block.weights:
        raise ValueError(f"{kind} needs rows of whole {block.weights}-weight blocks, got {columns}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
        rows, columns // block.weights, block.nbytes
    )
    scales = (rows, columns // GROUP, 2) if block.layout == "Q8_1_16" else (rows, columns // GROUP)
    d, q, m = _UNPACK[kind](blocks)
    return Groups(
        block.layout,
        q.reshape(rows, columns // GROUP, GROUP),
        d.reshape(scales).astype(np.float32),
        np.zeros(scales, np.float32) if m is None else m.reshape(scales),
    )


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, widened to float32 (exactly)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] weights: low nibbles are weights 0-15, high ones 16-31."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


Unpacked = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]  # d, q, m


def _q4_0(blocks: np.ndarray) -> Unpacked:
    d = _half(blocks, 0)
    return d, _nibbles(blocks[..., 2:]), -8 * d


def _q4_1(blocks: np.ndarray) -> Unpacked:
    return _half(blocks, 0), _nibbles(blocks[..., 4:]), _half(blocks, 2)


def _q2_k(blocks: np.ndarray) -> Unpacked:
    """A super-block: sixteen bytes of a 4-bit scale (low nibble) and min (high) a 16 weights,
    64 bytes of 2-bit q (weight 128h + 32s + j in bits 2s, 2s+1 of byte 32h + j), d, dmin.
    Per 16 weights d*sc and -(dmin*mn), exact in float32."""
    lead = blocks.shape[:-1]
    fields = blocks[..., :16]
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[:, None]  # [4, 1]
    q = (blocks[..., 16:80].reshape(*lead, 2, 1, 32) >> shifts) & 3  # [..., h, s, j]
    d, dmin = _half(blocks, 80)[..., None], _half(blocks, 82)[..., None]
    return d * (fields & 15), q.reshape(*lead, SUPER).view(np.int8), -(dmin * (fields >> 4))


def _q3_k(blocks: np.ndarray) -> Unpacked:
    """A super-block: 32 bytes of high bits, 64 of two-bit lows, 12 of sixteen 6-bit scales
    (one a 16 weights), d. Weight 128h + 32s + j has bits 2s, 2s+1 of low byte 32h + j and bit
    4h + s of high byte j: q is those three bits less 4, a set high bit meaning none less.
    Scale i has the low (i < 8) or high nibble of byte i mod 8, below bits 2(i div 4),
    2(i div 4) + 1 of byte 8 + i mod 4, less 32. As Q6_K's, the kernel's q is the exact integer
    (scale - 32)·q (|q| <= 128) and its d the super-block's."""
    lead = blocks.shape[:-1]
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[:, None]  # [4, 1]
    low = (blocks[..., 32:96].reshape(*lead, 2, 1, 32) >> shifts) & 3  # [..., h, s, j]
    bits = np.arange(8, dtype=np.uint8)[:, None]
    high = (blocks[..., :32].reshape(*lead, 1, 32) >> bits) & 1  # [..., 4h + s, j]
    q = low.reshape(*lead, SUPER).astype(np.int16) + 4 * high.reshape(*lead, SUPER) - 4
    fields = blocks[..., 96:108]
    nibbles = np.concatenate([fields[..., :8] & 15, fields[..., :8] >> 4], axis=-1)
    tops = (fields[..., 8:12].reshape(*lead, 1, 4) >> shifts) & 3  # [..., i div 4, i mod 4]
    scales = (nibbles | (tops.reshape(*lead, 16) << 4)).astype(np.int16) - 32
    q = q.reshape(*lead, 16, 16) * scales[..., None]
    d = np.repeat(_half(blocks, 108)[..., None], SUPER // GROUP, axis=-1)
    return d, q.reshape(*lead, SUPER // GROUP, GROUP), None


def _q4_k(blocks: np.ndarray) -> Unpacked:
    """A super-block: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles
    (byte j of each 32 holds weight j of two groups: 2i in its low, 2i+1 in its high nibble)."""
    scales, mins = _k_scales_mins(blocks)
    return scales, _k_nibbles(blocks[..., 16:]), mins


def _q5_k(blocks: np.ndarray) -> Unpacked:
    """Q4_K's fields, then 32 bytes of high bits (bit g of byte j: weight j of group g's fifth
    bit), then Q4_K's nibbles."""
    scales, mins = _k_scales_mins(blocks)
    bits = np.arange(8, dtype=np.uint8)[:, None]
    high = (blocks[..., 16:48].reshape(*blocks.shape[:-1], 1, 32) >> bits) & 1  # [..., g, j]
    q = _k_nibbles(blocks[..., 48:]) | (high << 4)
    return scales, q.view(np.int8), mins


def _k_scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight group scales d*sc and mins -(dmin*mn) [..., 8] from the
    super-block's d, dmin and 12 bytes of 6-bit fields (products exact in float32)."""
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]
    fields = blocks[..., 4:16]
    low, high, mixed = fields[..., 0:4], fields[..., 4:8], fields[..., 8:12]
    # groups 0-3: six bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7: a nibble of
    # bytes 8-11 below the two top bits of bytes 0-3 (scales) and 4-7 (mins)
    scales = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return d * scales, -(dmin * mins)


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 128] bytes -> [..., 8 groups, 32]: byte j of each 32 holds weight j of groups 2i
    (low nibble) and 2i+1 (high)."""
    nibbles = packed.reshape(*packed.shape[:-1], 4, 1, 32)
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-2)  # [..., 4, 2, 32]: group 2i + h
    return q.reshape(*packed.shape[:-1], 8, 32)


def _q5_0(blocks: np.ndarray) -> Unpacked:
    return _half(blocks, 0), _five_bits(blocks[..., 2:]).view(np.int8) - np.int8(16), None


def _q5_1(blocks: np.ndarray) -> Unpacked:
    return _half(blocks, 0), _five_bits(blocks[..., 4:]).view(np.int8), _half(blocks, 2)


def _five_bits(fields: np.ndarray) -> np.ndarray:
    """[..., 20] bytes (a little-endian uint32 whose bit j is weight j's fifth bit, then 16
    bytes of nibbles) -> [..., 32] uint8 q in 0..31."""
    high = fields[..., :4].copy().view("<u4")
    bits = ((high >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(fields[..., 4:]) | (bits << 4)


def _q6_k(blocks: np.ndarray) -> Unpacked:
    """A super-block: 128 bytes of low nibbles, 64 of two-bit highs, sixteen int8 scales (one
    a 16 weights), d. Weight 128h + 64s + j has nibble s of low byte 64h + j; weight
    128h + 32s + j has bits 2s, 2s+1 of high byte 32h + j. The kernel's q is the exact integer
    scale * (q - 32) (|q| <= 4096, int16) and its d the super-block's: d*(scale*q) is the
    product gguf-py rounds once, (d*scale)*q with d*scale exact."""
    lead = blocks.shape[:-1]
    low = blocks[..., :128].reshape(*lead, 2, 1, 64)
    low = np.concatenate([low & 15, low >> 4], axis=-2).reshape(*lead, SUPER)
    high = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = ((high >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(*lead, SUPER)
    q = (low | (high << 4)).astype(np.int16) - np.int16(32)
    scales = blocks[..., 192:208].view(np.int8).astype(np.int16)
    q = q.reshape(*lead, 16, 16) * scales[..., None]
    d = np.repeat(_half(blocks, 208)[..., None], SUPER // GROUP, axis=-1)
    return d, q.reshape(*lead, SUPER // GROUP, GROUP), None


def _q8_0(blocks: np.ndarray) -> Unpacked:
    return _half(blocks, 0), blocks[..., 2:].view(np.int8), None


_UNPACK = {
    "Q2_K": _q2_k,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q8_0": _q8_0,
}
