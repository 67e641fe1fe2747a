"""Numba kernels for the per-layer steps of the packed CPU path around its matmuls: RMSNorm;
rotary embedding together with the KV-cache write (attention:
`service/kernels/attention_kernel.py`).

On a CPU a one-token pass of a small model spends a large share of its time outside the
matmuls, in operators that each cost microseconds whatever their size: `F.rms_norm` runs as
six operators, the rotary embedding plus the scatter of the new keys and values into the cache
as eleven (two of them advanced-index writes). Each becomes one call here (docs/benchmarks.md,
"The float path's kernels").

Each token is computed on its own, with the same arithmetic whatever the pass holds, so a
row's result does not depend on the pass size (speculation still reproduces plain decoding
bit for bit). The rotary embedding and the cache write do exactly what the torch operators
do (one multiply, one multiply and one add per element, no fused multiply-add): the same bits.
RMSNorm sums its squares in order, where torch sums them in vector lanes: the last bit can
differ from `F.rms_norm`, as the packed matmuls' sums already differ from float32 matmuls.

Loaded with the packed-linear kernels (`service.kernels.packed_linear.load_kernels`), into the same
numba cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload


@njit(cache=True, nogil=True)
def rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    """out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)) for every token t of x [T, hidden]
    (float32 throughout, as transformers' Llama RMSNorm computes it for float32 inputs)."""
    tokens, hidden = x.shape
    for t in range(tokens):
        total = np.float32(0.0)
        for i in range(hidden):
            total += x[t, i] * x[t, i]
        scale = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = weight[i] * (x[t, i] * scale)


@njit(cache=True, nogil=True)
def rotate_and_store(
    qkv, cos, sin, heads, keys, values, rows, positions, queries
):  # pragma: no cover - compiled
    """Rotary embedding of a pass's queries and keys, and the cache write of its keys and values.

    qkv [T, heads + 2 * kv_heads, head_dim]: the fused projection's output (queries, keys,
    values); cos, sin [T, rotary_dim]: each token's rotary tables, which turn the first
    rotary_dim dimensions of each head (all of them but for a partial rotary embedding,
    Phi-4-mini's); the rest pass as they are. Writes the rotated queries to
    queries [T, heads, head_dim], the rotated keys and the values to keys/values [rows, kv_heads,
    capacity, head_dim] at (rows[t], positions[t]): float32, or float16 given as its uint16
    bits (rounded to the nearest, ties to even, as torch and numpy round). Rotation as
    transformers' `rotate_half` convention: x * cos + [-x2, x1] * sin."""
    tokens, _, dim = qkv.shape
    kv_heads = keys.shape[1]
    turned = cos.shape[1]
    half = turned // 2
    entries = np.empty((tokens, 2, kv_heads, dim), np.float32)  # each token's keys and values
    for t in range(tokens):
        for h in range(heads + kv_heads):
            for i in range(half):
                low, high = qkv[t, h, i], qkv[t, h, i + half]
                rotated_low = low * cos[t, i] + (-high) * sin[t, i]
                rotated_high = high * cos[t, i + half] + low * sin[t, i + half]
                if h < heads:
                    queries[t, h, i] = rotated_low
                    queries[t, h, i + half] = rotated_high
                else:
                    entries[t, 0, h - heads, i] = rotated_low
                    entries[t, 0, h - heads, i + half] = rotated_high
        if turned < dim:  # a partial rotary embedding: the rest of each head as it is
            queries[t, :, turned:] = qkv[t, :heads, turned:]
            entries[t, 0, :, turned:] = qkv[t, heads : heads + kv_heads, turned:]
        entries[t, 1] = qkv[t, heads + kv_heads :]
    _store_entries(entries, keys, values, rows, positions)


def _store_entries(
    entries, keys, values, rows, positions
):  # pragma: no cover - compiled through the overload
    """keys/values[rows[t], :, positions[t]] = entries[t, 0]/entries[t, 1], in the cache's type."""


@overload(_store_entries, jit_options={"cache": True})
def _store_entries_of(entries, keys, values, rows, positions):  # pragma: no cover - compiled
    as_cached = half_bits if keys.dtype == types.uint16 else _unchanged

    def store(entries, keys, values, rows, positions):
        cached = as_cached(entries)
        for t in range(entries.shape[0]):
            keys[rows[t], :, positions[t]] = cached[t, 0]
            values[rows[t], :, positions[t]] = cached[t, 1]

    return store


@njit(cache=True, inline="always")
def _unchanged(x):  # pragma: no cover - compiled
    return x


@njit(cache=True)
def half_bits(x):  # pragma: no cover - compiled
    """The float16 bits (uint16) nearest each float32 of x (contiguous), ties to even: float16
    normals by rounding the float32 bits at bit 13, subnormals (below 2^-14) by letting a
    float32 addition of 0.5 round them to units of 2^-24. Branch-free, so it vectorizes."""
    flat = x.reshape(-1)
    bits = flat.view(np.uint32)
    plus_half = (np.abs(flat) + np.float32(0.5)).view(np.uint32)
    out = np.empty(flat.shape, np.uint16)
    for i in range(flat.shape[0]):
        magnitude = bits[i] & np.uint32(0x7FFFFFFF)
        normal = (
            (magnitude + np.uint32(0xFFF) + ((magnitude >> np.uint32(13)) & np.uint32(1)))
            >> np.uint32(13)
        ) - np.uint32(0x1C000)
        h = plus_half[i] - np.uint32(0x3F000000) if magnitude < np.uint32(0x38800000) else normal
        # 2^16 and above, infinity
        h = np.uint32(0x7C00) if magnitude >= np.uint32(0x47800000) else h
        h = np.uint32(0x7E00) if magnitude > np.uint32(0x7F800000) else h  # NaN
        out[i] = np.uint16(((bits[i] >> np.uint32(16)) & np.uint32(0x8000)) | h)
    return out.reshape(x.shape)


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels for the argument types passes use."""
    x = np.zeros((1, 4), np.float32)
    rms_norm(x, np.ones(4, np.float32), 1e-5, np.empty_like(x))
    cache = np.zeros((1, 1, 2, 4), np.float32)
    index = np.zeros(1, np.int64)
    for cache in (cache, np.zeros(cache.shape, np.uint16)):  # float32, float16 bits
        rotate_and_store(
            np.zeros((1, 3, 4), np.float32),
            x,
            x,
            1,
            cache,
            cache.copy(),
            index,
            index,
            np.empty((1, 1, 4), np.float32),
        )
