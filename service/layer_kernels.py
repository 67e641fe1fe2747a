"""Numba kernels for the per-layer steps of the packed CPU path around its matmuls: RMSNorm;
rotary embedding together with the KV-cache write; attention of one-token rows.

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

Attention of a batch of decoding rows (`one_token_attention`): each row's query attends to
its own committed length, where one batched `scaled_dot_product_attention` call pads every row
to the longest and repeats the shared key/value heads for each query head. With Spec-Bench
prompts of very different lengths side by side that padding made attention more than half of a
16-row pass (84.6 of 146 ms, 2-core Xeon VM; docs/benchmarks.md, thirteenth session). A query
sees its columns in position order (committed ones, then its tree ancestors) and every sum runs
over them in that order, whatever else the pass holds: a tree node and the same token decoded
alone get the same bits. The exponential is a polynomial in vector lanes (Cephes' expf, within
a few float32 ulps): numba's `np.exp` is a scalar libm call per score.

Loaded with the packed-linear kernels (`service.packed_linear.load_kernels`), into the same
numba cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


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


# fastmath liberties of the attention kernel: vectorized sums (reassociated, in an order fixed
# by the compiled code and the number of columns) and fused multiply-adds; no assumption about
# infinities or NaN.
ATTENTION_MATH = {"contract", "reassoc"}
LOG2E = np.float32(1.4426950408889634)
LN2_HIGH, LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 in two parts
LOWEST_EXPONENT = np.float32(-87.0)  # exp(-87) is about float32's smallest normal number


@njit(parallel=True, cache=True, nogil=True)
def one_token_attention(queries, keys, values, tokens, rows, starts, columns, column_offsets, scale,
                        out):  # pragma: no cover - compiled
    """Attention of the flat tokens `tokens` [n] of a pass, each over its own KV row.

    queries [T, heads, head_dim]; keys, values [rows, kv_heads, capacity, head_dim] (the cache's
    whole buffers); token i attends to columns [0, starts[i]) of row rows[i], then to the columns
    columns[column_offsets[i]:column_offsets[i + 1]] (its tree ancestors and itself, ascending).
    Writes out[tokens[i]] [heads, head_dim]. One task per (token, KV head): its query heads
    share the key and value reads."""
    heads = queries.shape[1]
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    for task in prange(tokens.shape[0] * kv_heads):
        i, kv_head = task // kv_heads, task % kv_heads
        token, row = tokens[i], rows[i]
        _attend(queries[token], keys[row, kv_head], values[row, kv_head], starts[i],
                columns[column_offsets[i]:column_offsets[i + 1]], kv_head * group, group, scale, out[token])


@njit(fastmath=ATTENTION_MATH, cache=True)
def _attend(query, keys, values, start, tree, first_head, group, scale, out):  # pragma: no cover - compiled
    """Query heads first_head.. (`group` of them) of one token over keys/values [capacity,
    head_dim]: columns [0, start), then `tree`."""
    n = start + tree.shape[0]
    scores = np.empty((group, n), np.float32)
    for j in range(start):
        _scores(query, first_head, group, keys[j], scale, scores, j)
    for i in range(tree.shape[0]):
        _scores(query, first_head, group, keys[tree[i]], scale, scores, start + i)
    bits = np.empty(n, np.int32)
    totals = np.empty(group, np.float32)
    for h in range(group):
        totals[h] = _exponentials(scores[h], bits.view(np.float32), bits)
    weighted = np.zeros((group, query.shape[1]), np.float32)
    for j in range(start):
        _accumulate(weighted, scores, j, values[j])
    for i in range(tree.shape[0]):
        _accumulate(weighted, scores, start + i, values[tree[i]])
    for h in range(group):
        for c in range(weighted.shape[1]):
            out[first_head + h, c] = weighted[h, c] / totals[h]


@njit(fastmath=ATTENTION_MATH, cache=True, inline="always")
def _scores(query, first_head, group, key, scale, scores, column):  # pragma: no cover - compiled
    for h in range(group):
        total = np.float32(0.0)
        for c in range(key.shape[0]):
            total += query[first_head + h, c] * key[c]
        scores[h, column] = total * scale


@njit(fastmath=ATTENTION_MATH, cache=True, inline="always")
def _accumulate(weighted, scores, column, value):  # pragma: no cover - compiled
    for h in range(weighted.shape[0]):
        p = scores[h, column]
        for c in range(value.shape[0]):
            weighted[h, c] += p * value[c]


@njit(fastmath=ATTENTION_MATH, cache=True)
def _exponentials(scores, powers, bits):  # pragma: no cover - compiled
    """scores <- exp(scores - max(scores)) in place; returns their sum. exp(x) = 2^k * exp(r)
    with r = x - k ln 2 in [-ln2/2, ln2/2] and exp(r) Cephes' degree-7 polynomial; 2^k is built
    in `bits` (viewed as float32 by `powers`). Written as plain loops so LLVM vectorizes them."""
    n = scores.shape[0]
    highest = scores[0]
    for j in range(1, n):
        highest = max(highest, scores[j])
    for j in range(n):
        x = max(scores[j] - highest, LOWEST_EXPONENT)
        k = np.floor(x * LOG2E + np.float32(0.5))
        r = x - k * LN2_HIGH - k * LN2_LOW
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        scores[j] = p * r * r + r + np.float32(1.0)
        bits[j] = (np.int32(k) + np.int32(127)) << 23
    total = np.float32(0.0)
    for j in range(n):
        scores[j] *= powers[j]
        total += scores[j]
    return total


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels for the argument types passes use."""
    x = np.zeros((1, 4), np.float32)
    rms_norm(x, np.ones(4, np.float32), 1e-5, np.empty_like(x))
    cache = np.zeros((1, 1, 2, 4), np.float32)
    index = np.zeros(1, np.int64)
    rotate_and_store(np.zeros((1, 3, 4), np.float32), x, x, 1, cache, cache.copy(), index, index,
                     np.empty((1, 1, 4), np.float32))
    one_token_attention(np.zeros((1, 1, 4), np.float32), cache, cache, index, index, index, index,
                        np.array([0, 1]), np.float32(1.0), np.empty((1, 1, 4), np.float32))
