"""Numba kernels for the per-layer steps of the packed CPU path around its matmuls: RMSNorm;
rotary embedding together with the KV-cache write (attention: `service/attention_kernel.py`).

On a CPU a one-token pass of a small model spends a large share of its time outside the
matmuls, in operators that each cost microseconds whatever their size: in the embedded model's
one-token pass (2-core Xeon VM, L=256) the two RMSNorms of a layer cost ~32 us each through
`F.rms_norm` (it runs as six operators), and the rotary embedding plus the scatter of the new
keys and values into the cache ~67 us (eleven operators, two of them advanced-index writes),
against a ~0.6 ms layer. Each becomes one call here, a few microseconds.

Each token is computed on its own, with the same arithmetic whatever the pass holds, so a
row's result does not depend on the pass size (speculation still reproduces plain decoding
bit for bit). The rotary embedding and the cache write do exactly what the torch operators
do (one multiply, one multiply and one add per element, no fused multiply-add): the same bits.
RMSNorm sums its squares in order, where torch sums them in vector lanes: the last bit can
differ from `F.rms_norm`, as the packed matmuls' sums already differ from float32 matmuls.

Loaded with the packed-linear kernels (`service.packed_linear.load_kernels`), into the same
numba cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit


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
def rotate_and_store(qkv, cos, sin, heads, keys, values, rows, positions, queries):  # pragma: no cover - compiled
    """Rotary embedding of a pass's queries and keys, and the cache write of its keys and values.

    qkv [T, heads + 2 * kv_heads, head_dim]: the fused projection's output (queries, keys,
    values); cos, sin [T, head_dim]: each token's rotary tables. Writes the rotated queries to
    queries [T, heads, head_dim], the rotated keys and the values to keys/values [rows, kv_heads,
    capacity, head_dim] at (rows[t], positions[t]). Rotation as transformers' `rotate_half`
    convention: x * cos + [-x2, x1] * sin."""
    tokens, _, dim = qkv.shape
    kv_heads = keys.shape[1]
    half = dim // 2
    for t in range(tokens):
        row, position = rows[t], positions[t]
        for h in range(heads + kv_heads):
            for i in range(half):
                low, high = qkv[t, h, i], qkv[t, h, i + half]
                rotated_low = low * cos[t, i] + (-high) * sin[t, i]
                rotated_high = high * cos[t, i + half] + low * sin[t, i + half]
                if h < heads:
                    queries[t, h, i] = rotated_low
                    queries[t, h, i + half] = rotated_high
                else:
                    keys[row, h - heads, position, i] = rotated_low
                    keys[row, h - heads, position, i + half] = rotated_high
        for h in range(kv_heads):
            for i in range(dim):
                values[row, h, position, i] = qkv[t, heads + kv_heads + h, i]


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels for the argument types passes use."""
    x = np.zeros((1, 4), np.float32)
    rms_norm(x, np.ones(4, np.float32), 1e-5, np.empty_like(x))
    cache = np.zeros((1, 1, 2, 4), np.float32)
    index = np.zeros(1, np.int64)
    rotate_and_store(np.zeros((1, 3, 4), np.float32), x, x, 1, cache, cache.copy(), index, index,
                     np.empty((1, 1, 4), np.float32))
