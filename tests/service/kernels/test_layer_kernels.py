"""The packed path's per-layer kernels (`service/kernels/layer_kernels.py`) against the torch
operators they replace, and the packed pass with them against the same pass without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.kernels.layer_kernels import half_bits
from service.kernels.packed_linear import load_kernels, loaded_layer_kernels
from service.model import decoder_pass
from service.model import runner as runner_module
from service.model.attention import build_layout
from service.model.decoder_pass import _rotate, attention_kernel_width
from service.model.runner import ModelRunner, RowInput
from service.model.tree import build_tree, chain_tree
from tests.helpers.kernels import needs_numba
from tests.helpers.passes import DRAFTS, PROMPT, assert_nodes_match, prefilled

pytestmark = needs_numba
load_kernels()  # where numba is installed and they fail to load, every test here fails


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_rms_norm_matches_torch_and_each_token_stands_alone(tokens: int) -> None:
    kernels = loaded_layer_kernels()
    generator = torch.Generator().manual_seed(tokens)
    x, weight = torch.randn(tokens, 576, generator=generator), torch.randn(576, generator=generator)
    out = torch.empty_like(x)
    kernels.rms_norm(x.numpy(), weight.numpy(), 1e-5, out.numpy())
    torch.testing.assert_close(out, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    alone = torch.empty(1, 576)
    kernels.rms_norm(x[-1:].numpy(), weight.numpy(), 1e-5, alone.numpy())
    assert torch.equal(alone[0], out[-1])  # a token's result does not depend on the pass size


@pytest.mark.parametrize("turned", [16, 8, 6])
def test_rotate_and_store_gives_the_torch_operators_bits(turned: int) -> None:
    """Queries rotated, keys rotated and values written at each token's (row, position); with
    a partial rotary embedding (`turned` of 16 dimensions, as Phi-4-mini's) the rest of each
    head as it was."""
    kernels = loaded_layer_kernels()
    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=generator)
    cos, sin = (
        torch.randn(tokens, turned, generator=generator),
        torch.randn(tokens, turned, generator=generator),
    )
    rows, positions = torch.tensor([0, 0, 2, 1, 2]), torch.tensor([3, 4, 0, 7, 1])
    keys, values = torch.zeros(3, kv_heads, 8, dim), torch.zeros(3, kv_heads, 8, dim)
    queries = torch.empty(tokens, heads, dim)
    kernels.rotate_and_store(
        qkv.numpy(),
        cos.numpy(),
        sin.numpy(),
        heads,
        keys.numpy(),
        values.numpy(),
        rows.numpy(),
        positions.numpy(),
        queries.numpy(),
    )
    rotated = _rotate(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
    want_keys, want_values = torch.zeros_like(keys), torch.zeros_like(values)
    want_keys[rows, :, positions] = rotated[:, heads:]
    want_values[rows, :, positions] = qkv[:, heads + kv_heads :]
    assert torch.equal(queries, rotated[:, :heads])
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_a_float16_cache_gets_torchs_rounding_of_the_same_entries() -> None:
    """The 8-bit path's float16 cache (given as uint16 bits) holds exactly what rounding the
    float32 cache's entries with torch gives."""
    kernels = loaded_layer_kernels()
    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=generator) * 100
    cos, sin = (
        torch.randn(tokens, dim, generator=generator),
        torch.randn(tokens, dim, generator=generator),
    )
    rows, positions = torch.tensor([0, 0, 2, 1, 2]), torch.tensor([3, 4, 0, 7, 1])
    caches = {
        dtype: (
            torch.zeros(3, kv_heads, 8, dim, dtype=dtype),
            torch.zeros(3, kv_heads, 8, dim, dtype=dtype),
        )
        for dtype in (torch.float32, torch.float16)
    }
    for dtype, (keys, values) in caches.items():
        as_kernel = (
            (lambda t: t.numpy().view(np.uint16))
            if dtype == torch.float16
            else (lambda t: t.numpy())
        )
        kernels.rotate_and_store(
            qkv.numpy(),
            cos.numpy(),
            sin.numpy(),
            heads,
            as_kernel(keys),
            as_kernel(values),
            rows.numpy(),
            positions.numpy(),
            torch.empty(tokens, heads, dim).numpy(),
        )
    (keys, values), (half_keys, half_values) = caches[torch.float32], caches[torch.float16]
    assert torch.equal(half_keys, keys.half()) and torch.equal(half_values, values.half())


def test_float16_rounding_is_numpys_on_every_kind_of_value() -> None:
    """Ties to even, subnormals, the overflow to infinity at 65520, infinities and NaN, and
    random bit patterns."""
    edges = [
        0.0,
        -0.0,
        1.0,
        1 + 2**-11,
        1 + 3 * 2**-11,
        65504,
        65519.99,
        65520,
        65536,
        1e10,
        np.inf,
        -np.inf,
        2**-14,
        2**-14 * 0.999,
        2**-24,
        1.5 * 2**-24,
        2.5 * 2**-24,
        2**-25,
        2**-25 * 1.0000001,
        2**-26,
    ]
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            np.array(edges, np.float32),
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ]
    )
    values = values[~np.isnan(values)]
    with np.errstate(over="ignore"):
        assert np.array_equal(half_bits(values), values.astype(np.float16).view(np.uint16))
    assert np.isnan(half_bits(np.array([np.nan, -np.nan], np.float32)).view(np.float16)).all()


def test_the_packed_pass_with_its_layer_kernels_matches_the_torch_operators(
    tiny_packed, monkeypatch
) -> None:
    _, packed, _, _ = tiny_packed
    runner = ModelRunner(packed)
    assert decoder_pass.packed_pass_kernels(packed) is loaded_layer_kernels()
    tree = build_tree(PROMPT[-1], DRAFTS)
    with_kernels = runner.forward(prefilled(runner, [PROMPT]), [RowInput(tree)])[0]
    for module in (decoder_pass, runner_module):  # the torch operators' pass
        monkeypatch.setattr(module, "packed_pass_kernels", lambda model: None)
    runner = ModelRunner(packed)  # its layouts without the kernels' queries
    without = runner.forward(prefilled(runner, [PROMPT]), [RowInput(tree)])[0]
    torch.testing.assert_close(with_kernels, without, rtol=1e-4, atol=1e-4)


def test_one_token_rows_of_a_packed_pass_attend_through_the_kernel(tiny_packed) -> None:
    """Plain rows of other lengths beside a tree row: the plain rows go to the kernel, the tree
    gets a call of its own, and every node's logits are those of decoding its path alone."""
    _, packed, _, _ = tiny_packed
    runner = ModelRunner(packed)
    prompts = [PROMPT, [7, 3], list(range(2, 40)), [11, 12, 13]]
    cache = prefilled(runner, prompts)
    trees = [
        chain_tree([prompts[0][-1]]),
        chain_tree([prompts[1][-1]]),
        build_tree(prompts[2][-1], DRAFTS),
        chain_tree([prompts[3][-1]]),
    ]
    layout = build_layout(
        trees, cache.lengths, runner.device, kernel_width=attention_kernel_width(packed)
    )
    assert layout.kernel_queries is not None and layout.kernel_queries.rows.tolist() == [0, 1, 3]
    assert layout.separate_rows == [2]
    logits = runner.forward(cache, [RowInput(tree) for tree in trees])
    for prompt, tree, row_logits in zip(prompts, trees, logits):
        assert_nodes_match(packed, prompt, tree, row_logits, tolerance=1e-4)


def test_a_tree_of_up_to_the_kernel_width_attends_through_it_with_its_tokens_bits_decoded_alone(
    tiny_packed,
) -> None:
    """A four-node chain beside a one-token row: both rows go to the kernel (no call of their
    own), and each node's logits are bit for bit those of its token decoded alone after the
    ones before it, so speculation with such trees reproduces plain decoding exactly."""
    _, packed, _, _ = tiny_packed
    runner = ModelRunner(packed)
    chain = [PROMPT[-1], 5, 9, 2]
    assert attention_kernel_width(packed) == len(chain)
    prompts = [PROMPT, [7, 3]]
    cache = prefilled(runner, prompts)
    trees = [chain_tree(chain), chain_tree([prompts[1][-1]])]
    layout = build_layout(
        trees, cache.lengths, runner.device, kernel_width=attention_kernel_width(packed)
    )
    assert layout.kernel_queries is not None and layout.kernel_queries.rows.tolist() == [0] * len(
        chain
    ) + [1]
    assert layout.separate_rows == []
    in_tree = runner.forward(cache, [RowInput(tree) for tree in trees])[0]
    alone = prefilled(runner, [PROMPT])
    for node, token in enumerate(chain):
        assert torch.equal(
            runner.forward(alone, [RowInput(chain_tree([token]))])[0][0], in_tree[node]
        )
        alone.commit(0, [0])
