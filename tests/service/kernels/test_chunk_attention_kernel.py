"""Prompt tokens' attention on the packed CPU path (`service/kernels/chunk_attention_kernel.py`):
causal attention as SDPA computes it, with bits that depend on the query alone, so a prompt
gets the same cache and logits however it is cut into chunks; tree nodes still take the
per-token kernel (speculation stays exact)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from drafting.base import Draft
from service.kernels.chunk_attention_kernel import LANES, chunk_attention, chunk_kernel_fits
from service.model.attention import build_layout, kernel_array, prompt_prefix
from service.model.runner import ModelRunner, RowInput
from service.model.tree import build_tree, chain_tree, prepend_chain
from tests.helpers.kernels import needs_numba

pytestmark = needs_numba


def chunk_attention_of(queries, keys, values, blocks, scale=0.125, softcap=0.0, window=0):
    """`blocks`: (row, first flat token, its position, count) each; scores capped at `softcap`
    (0: uncapped), each token seeing the `window` columns up to its own (0: all)."""
    out = torch.full_like(queries, float("nan"))
    rows, tokens, firsts, counts = (np.array(column, dtype=np.int64) for column in zip(*blocks))
    chunk_attention(
        queries.shape[2],
        queries.shape[1] // keys.shape[1],
        keys.dtype == torch.float16,
        softcap,
        window,
    )(
        queries.numpy(),
        kernel_array(keys),
        kernel_array(values),
        rows,
        tokens,
        firsts,
        counts,
        np.float32(scale),
        out.numpy(),
    )
    return out


def blocks_of(row: int, first_token: int, first_position: int, count: int, size: int = LANES):
    return [
        (row, first_token + i, first_position + i, min(size, count - i))
        for i in range(0, count, size)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_prompt_token_attends_causally_as_sdpa_does(dtype) -> None:
    """Two rows' chunks after cached columns, three query heads a KV head: each token over its
    row's columns up to its own position."""
    generator = torch.Generator().manual_seed(0)
    dim, capacity = 64, 80
    keys = torch.randn(2, 3, capacity, dim, generator=generator).to(dtype)
    values = torch.randn(2, 3, capacity, dim, generator=generator).to(dtype)
    queries = torch.randn(50, 9, dim, generator=generator)
    got = chunk_attention_of(
        queries, keys, values, blocks_of(0, 0, 10, 30) + blocks_of(1, 30, 0, 20)
    )
    for token in range(50):
        row, position = (0, 10 + token) if token < 30 else (1, token - 30)
        want = F.scaled_dot_product_attention(
            queries[token, :, None],
            keys[row, :, : position + 1].float(),
            values[row, :, : position + 1].float(),
            scale=0.125,
            enable_gqa=True,
        )
        torch.testing.assert_close(got[token], want[:, 0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_a_windowed_layers_tokens_attend_to_their_window(window, dtype) -> None:
    """A layer of sliding window W: each token over the W columns up to its own position, as
    transformers' masks rule (a key at or below position - W is not seen), from blocks that
    start anywhere; and the window bites (the prompt outgrows it)."""
    generator = torch.Generator().manual_seed(3)
    dim, capacity = 32, 80
    keys = torch.randn(2, 2, capacity, dim, generator=generator).to(dtype)
    values = torch.randn(2, 2, capacity, dim, generator=generator).to(dtype)
    queries = torch.randn(70, 4, dim, generator=generator)
    blocks = blocks_of(0, 0, 9, 50) + blocks_of(1, 50, 3, 20, size=7)
    got = chunk_attention_of(queries, keys, values, blocks, window=window)
    for token in range(70):
        row, position = (0, 9 + token) if token < 50 else (1, token - 47)
        low = max(0, position - window + 1)
        want = F.scaled_dot_product_attention(
            queries[token, :, None],
            keys[row, :, low : position + 1].float(),
            values[row, :, low : position + 1].float(),
            scale=0.125,
            enable_gqa=True,
        )
        torch.testing.assert_close(got[token], want[:, 0], rtol=2e-5, atol=2e-6)
    dense = chunk_attention_of(queries, keys, values, blocks)
    assert not torch.allclose(got, dense, rtol=1e-3, atol=1e-3)


def test_capped_scores_match_transformers_eager_attention() -> None:
    """Gemma 2's soft-capped scores, most past the cap: each prompt token as transformers'
    eager attention computes it (scaled, capped, then the softmax), and the cap bites."""
    generator = torch.Generator().manual_seed(2)
    dim, cap = 16, 5.0
    keys = 4 * torch.randn(1, 2, 40, dim, generator=generator)
    values = torch.randn(1, 2, 40, dim, generator=generator)
    queries = 4 * torch.randn(30, 4, dim, generator=generator)
    got = chunk_attention_of(queries, keys, values, blocks_of(0, 0, 10, 30), softcap=cap)
    uncapped = chunk_attention_of(queries, keys, values, blocks_of(0, 0, 10, 30))
    for token in range(30):
        k, v = (t[0, :, : 11 + token].repeat_interleave(2, dim=0) for t in (keys, values))
        scores = (queries[token, :, None] @ k.transpose(1, 2))[:, 0] * 0.125
        weights = torch.softmax(torch.tanh(scores / cap) * cap, dim=-1)
        torch.testing.assert_close(got[token], (weights[:, None] @ v)[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, uncapped, rtol=1e-2, atol=1e-2)


def test_a_tokens_bits_do_not_depend_on_its_block() -> None:
    generator = torch.Generator().manual_seed(1)
    keys, values = (
        torch.randn(1, 2, 70, 16, generator=generator),
        torch.randn(1, 2, 70, 16, generator=generator),
    )
    queries = torch.randn(60, 4, 16, generator=generator)
    whole = chunk_attention_of(queries, keys, values, blocks_of(0, 0, 10, 60))
    for size in (1, 5, 7):
        assert torch.equal(
            chunk_attention_of(queries, keys, values, blocks_of(0, 0, 10, 60, size)), whole
        )
    # a chunk starting at 33
    later = chunk_attention_of(queries[23:], keys, values, blocks_of(0, 0, 33, 37))
    assert torch.equal(later, whole[23:])
    windowed = chunk_attention_of(queries, keys, values, blocks_of(0, 0, 10, 60), window=9)
    for size in (1, 5, 7):  # a windowed token's block starts below, at or above its window
        blocks = blocks_of(0, 0, 10, 60, size)
        assert torch.equal(chunk_attention_of(queries, keys, values, blocks, window=9), windowed)


def test_the_prompt_prefix_is_the_chain_before_the_logits() -> None:
    chunk = chain_tree([5, 6, 7, 8])
    assert prompt_prefix(chunk, 4) == 4  # a chunk needing no logits
    assert prompt_prefix(chunk, 3) == 3  # a prompt's last chunk: its last token gets logits
    tree = build_tree(9, [Draft((1, 2), "context"), Draft((3,), "context")])
    assert prompt_prefix(prepend_chain([5, 6, 7], tree), 3) == 3  # the chunk under the first tree
    assert prompt_prefix(tree, 0) == 0
    assert chunk_kernel_fits(64) and not chunk_kernel_fits(24)


def test_a_layout_gives_the_prompt_tokens_to_the_chunk_kernel_and_the_rest_to_the_others() -> None:
    """Row 0: a 20-token chunk under a tree; row 1: a decode row; row 2: a chunk alone."""
    trees = [
        prepend_chain(
            list(range(20)), build_tree(9, [Draft((1, 2), "context"), Draft((3,), "context")])
        ),
        chain_tree([4]),
        chain_tree(list(range(40))),
    ]
    layout = build_layout(
        trees, [0, 30, 5], torch.device("cpu"), kernel_width=1, prompts=[20, 0, 40]
    )
    chunks = layout.chunk_queries
    assert chunks is not None
    assert chunks.rows.tolist() == [0, 0, 2, 2, 2] and chunks.counts.tolist() == [16, 4, 16, 16, 8]
    assert chunks.tokens.tolist() == [0, 16, 25, 41, 57] and chunks.firsts.tolist() == [
        0,
        16,
        5,
        21,
        37,
    ]
    assert layout.kernel_queries is not None and layout.kernel_queries.tokens.tolist() == [
        24
    ]  # the decode row
    assert (
        layout.separate_rows == [0] and layout.batched_mask is None
    )  # row 0's four tree nodes: a call
    assert layout.attended == ([20, 24, 65], [4, 1, 0])
    assert layout.row_masks[0].shape[-2:] == (4, 24)  # the tree's nodes over the chunk and the tree


@pytest.mark.parametrize("path", ["gguf", "gguf-int8"])
def test_a_prompt_gets_the_same_cache_and_logits_however_it_is_chunked(
    path, tiny_packed, tmp_path
) -> None:
    """The same prompt in one chunk, in chunks of 7 and 16, and beside another row: equal bits."""
    from service.kernels.int8_kernel import int8_supported
    from service.kernels.packed_linear import pack_gguf_linears
    from tests.helpers.packed import tiny_gguf_twins

    if path == "gguf":
        model = tiny_packed[1]
    else:
        if not int8_supported():
            pytest.skip("the CPU has neither AVX2 nor AVX-512 VNNI")
        _, model, gguf = tiny_gguf_twins(tmp_path)
        pack_gguf_linears(model, gguf, int8_activations=True)
    runner = ModelRunner(model)
    assert runner.chunk_kernel
    prompt = [(7 * i + 3) % 60 for i in range(45)]

    def prefill(width: int, beside: bool = False):
        cache = runner.new_cache(2 if beside else 1)
        for at in range(0, len(prompt) - 1, width):
            chunk = prompt[at : min(at + width, len(prompt) - 1)]
            rows = [RowInput(chain_tree(chunk), logits_from=len(chunk))]
            if beside:
                rows.append(RowInput(chain_tree([11, 12, 13][: 1 + at % 3])))
            runner.forward(cache, rows)
            cache.commit_rows({row: list(range(r.tree.num_nodes)) for row, r in enumerate(rows)})
        logits = runner.forward(
            cache,
            [RowInput(chain_tree(prompt[-1:]))] + ([RowInput(chain_tree([14]))] if beside else []),
        )
        keys = torch.stack([layer.keys[0, :, : len(prompt)] for layer in cache.layers])
        return logits[0], keys

    whole_logits, whole_keys = prefill(len(prompt))
    for width, beside in ((7, False), (16, True)):
        logits, keys = prefill(width, beside)
        assert torch.equal(keys, whole_keys) and torch.equal(logits, whole_logits)
