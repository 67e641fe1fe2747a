"""The packed path's attention kernel (`service/kernels/attention_kernel.py`): each token over its
own row's columns, as SDPA computes it, and with the same bits whatever else the call holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.kernels.attention_kernel import lanes_for, token_attention
from service.model.attention import kernel_array


def kernel_attention_of(queries, keys, values, starts, paths, rows=None, scale=0.25, softcap=0.0):
    """Token i (of KV row rows[i], default i) over columns [0, starts[i]) then `paths[i]`,
    scores capped at `softcap` (0: uncapped)."""
    out = torch.full_like(queries, float("nan"))
    columns = [c for path in paths for c in path]
    offsets = torch.tensor([0, *[len(p) for p in paths]]).cumsum(0)
    rows = torch.arange(queries.shape[0]) if rows is None else torch.tensor(rows)
    token_attention(
        queries.shape[2], queries.shape[1] // keys.shape[1], keys.dtype == torch.float16, softcap
    )(
        queries.numpy(),
        kernel_array(keys),
        kernel_array(values),
        torch.arange(queries.shape[0]).numpy(),
        rows.numpy(),
        torch.tensor(starts).numpy(),
        torch.tensor(columns, dtype=torch.long).numpy(),
        offsets.numpy(),
        np.float32(scale),
        out.numpy(),
    )
    return out


def sdpa_of(queries, keys, values, starts, paths, rows=None, scale=0.25):
    expected = []
    for i, (start, path) in enumerate(zip(starts, paths)):
        row = i if rows is None else rows[i]
        seen = list(range(start)) + path
        expected.append(
            F.scaled_dot_product_attention(
                queries[i, :, None],
                keys[row, :, seen].float(),
                values[row, :, seen].float(),
                scale=scale,
                enable_gqa=True,
            )[:, 0]
        )
    return torch.stack(expected)


def test_the_attention_kernel_matches_sdpa_over_each_rows_own_columns() -> None:
    """Rows of other lengths in one call, three query heads per KV head; each token sees its
    committed columns and its tree path, nothing else (not the sibling branch at column 9)."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, capacity = 6, 2, 16, 40
    keys = torch.randn(3, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(3, kv_heads, capacity, dim, generator=generator)
    queries = torch.randn(3, heads, dim, generator=generator)
    starts, paths = [31, 5, 8], [[31], [5], [8, 10, 11]]
    out = kernel_attention_of(queries, keys, values, starts, paths)
    torch.testing.assert_close(
        out, sdpa_of(queries, keys, values, starts, paths), rtol=1e-5, atol=1e-6
    )


def capped_attention_of(queries, keys, values, starts, paths, scale, softcap):
    """Transformers' eager Gemma 2 attention of token i over its columns: scores scaled, then
    capped (softcap * tanh(score / softcap)), then the softmax."""
    expected = []
    for i, (start, path) in enumerate(zip(starts, paths)):
        seen = list(range(start)) + path
        group = queries.shape[1] // keys.shape[1]
        k, v = (t[i, :, seen].float().repeat_interleave(group, dim=0) for t in (keys, values))
        scores = (queries[i, :, None] @ k.transpose(1, 2))[:, 0] * scale  # [heads, columns]
        weights = torch.softmax(torch.tanh(scores / softcap) * softcap, dim=-1)
        expected.append((weights[:, None] @ v)[:, 0])
    return torch.stack(expected)


@pytest.mark.parametrize("dim", [16, 8])
def test_capped_scores_match_transformers_eager_attention(dim: int) -> None:
    """Gemma 2's soft-capped scores, most past the cap: the kernel's tanh (by its exp) agrees
    with torch's to float32 rounding, and the cap bites (uncapped attention differs)."""
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, capacity, cap = 4, 2, 40, 5.0
    keys = 4 * torch.randn(3, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(3, kv_heads, capacity, dim, generator=generator)
    queries = 4 * torch.randn(3, heads, dim, generator=generator)
    starts, paths = [31, 5, 8], [[31], [5], [8, 10, 11]]
    out = kernel_attention_of(queries, keys, values, starts, paths, softcap=cap)
    expected = capped_attention_of(queries, keys, values, starts, paths, 0.25, cap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    uncapped = sdpa_of(queries, keys, values, starts, paths)
    assert not torch.allclose(out, uncapped, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("dim", "heads", "kv_heads"), [(64, 9, 3), (128, 8, 2), (8, 4, 4), (12, 2, 1)]
)
def test_every_vector_width_and_column_count_matches_sdpa(
    dim: int, heads: int, kv_heads: int, cache_dtype: torch.dtype
) -> None:
    """Head sizes of 16, 8 and 4 lanes and column counts around every multiple of them (the
    last block of keys partly padding): the padding never leaks into a softmax. A float16
    cache (the 8-bit path's) is read as its values."""
    generator = torch.Generator().manual_seed(dim)
    lengths = list(range(1, 38))
    keys = torch.randn(len(lengths), kv_heads, 40, dim, generator=generator).to(cache_dtype)
    values = torch.randn(len(lengths), kv_heads, 40, dim, generator=generator).to(cache_dtype)
    queries = torch.randn(len(lengths), heads, dim, generator=generator) * 3
    starts, paths = [n - 1 for n in lengths], [[n - 1] for n in lengths]
    out = kernel_attention_of(queries, keys, values, starts, paths)
    torch.testing.assert_close(
        out, sdpa_of(queries, keys, values, starts, paths), rtol=1e-5, atol=1e-5
    )


def test_a_tree_node_gets_the_bits_of_the_same_token_decoded_alone() -> None:
    """Committed columns and ancestors are one ordered sequence: the node at columns 8, 10, 11
    of a tree equals the token at column 10 after committing 8 and 10's keys at 8 and 9."""
    generator = torch.Generator().manual_seed(1)
    keys, values = (
        torch.randn(1, 1, 16, 8, generator=generator),
        torch.randn(1, 1, 16, 8, generator=generator),
    )
    query = torch.randn(1, 3, 8, generator=generator)
    in_tree = kernel_attention_of(query, keys, values, [8], [[8, 10, 11]])
    committed_keys, committed_values = keys.clone(), values.clone()
    for source, target in ((10, 9), (11, 10)):
        committed_keys[0, 0, target], committed_values[0, 0, target] = (
            keys[0, 0, source],
            values[0, 0, source],
        )
    alone = kernel_attention_of(query, committed_keys, committed_values, [10], [[10]])
    assert torch.equal(in_tree, alone)


def test_a_prompt_chunks_tokens_get_the_bits_of_any_other_chunking() -> None:
    """A prompt of 45 tokens prefilled as one chunk, as chunks of 7, and token by token, beside
    other rows' tokens: every token's attention is the same bits each way."""
    generator = torch.Generator().manual_seed(2)
    length, dim = 45, 64
    keys = torch.randn(2, 3, length, dim, generator=generator)
    values = torch.randn(2, 3, length, dim, generator=generator)
    queries = torch.randn(length, 9, dim, generator=generator)
    whole = kernel_attention_of(
        queries,
        keys,
        values,
        [0] * length,
        [list(range(p + 1)) for p in range(length)],
        rows=[0] * length,
    )
    for width in (7, 1):
        starts = [p - p % width for p in range(length)]
        chunked = kernel_attention_of(
            queries,
            keys,
            values,
            starts,
            [list(range(s, p + 1)) for p, s in enumerate(starts)],
            rows=[0] * length,
        )
        assert torch.equal(chunked, whole)
    others = torch.cat([queries[:5], torch.randn(3, 9, dim, generator=generator)])
    beside = kernel_attention_of(
        others,
        keys,
        values,
        [0] * 5 + [10, 20, 30],
        [list(range(p + 1)) for p in range(5)] + [[10], [20], [30]],
        rows=[0] * 5 + [1] * 3,
    )
    assert torch.equal(beside[:5], whole[:5])


def test_a_head_size_the_kernel_cannot_split_is_refused() -> None:
    assert lanes_for(64) == 16 and lanes_for(24) == 8 and lanes_for(12) == 4
    with pytest.raises(ValueError, match="divisible by 4"):
        lanes_for(6)
