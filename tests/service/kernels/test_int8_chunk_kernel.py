"""The 8-bit linears' kernel for passes of many rows (`service/kernels/int8_chunk_kernel.py`):
the same bits as the kernel of every pass size, whatever the rows, threads and shapes, so a
decode row batched with a prompt chunk gets what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.kernels.int8_chunk_kernel import CHUNK_MIN_ROWS, GROUP, chunk_matmul_of
from service.kernels.int8_kernel import (
    BLOCK,
    int8_tiles,
    matmul_of,
    supported_isas,
)
from service.kernels.packed_linear import PackedLinear, tiles_from_blocks
from tests.helpers.kernels import needs_int8
from tests.helpers.packed import Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, random_blocks

pytestmark = needs_int8


def tiles(out_features: int, in_features: int, seed: int, isa, kind=Q4_1):
    t = tiles_from_blocks(
        random_blocks(out_features, in_features, seed=seed, kind=kind),
        out_features,
        in_features,
        kind.name,
    )
    relaid = int8_tiles(t.kind, t.qs, t.d, t.m, out_features, isa)
    assert relaid.kind == KINDS[kind.name]
    return relaid


# the 8-bit kind each file type's weights take (`int8_kernel`)
KINDS = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K": "Q4_K", "Q5_0": "Q5_0", "Q5_1": "Q8_1"}
KINDS |= {"Q5_K": "Q5_K"}
KINDS |= {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q3_K": "Q3_K"}


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 100])
@pytest.mark.parametrize(
    "kind,out_features,in_features",
    [(Q4_1, 16, 32), (Q4_1, 70, 96), (Q4_1, 96, 576), (Q4_1, 48, 1536)]
    + [(kind, 40, 768) for kind in (Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, Q6_K, Q3_K)],
    ids=str,
)
@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("isa", supported_isas(), ids=lambda isa: isa.name)
def test_the_chunk_kernel_gives_the_every_size_kernels_bits(
    rows, kind, out_features, in_features, threads, isa
) -> None:
    t = tiles(out_features, in_features, seed=rows, isa=isa, kind=kind)
    # rows of unlike ranges
    scale = torch.rand(rows, 1, generator=torch.Generator().manual_seed(rows)) * 8
    x = (
        torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows + 1)) * scale
    ).numpy()
    x[0, :BLOCK] = 0  # an all-zero block: scale 0
    want = np.empty((rows, t.padded_features), np.float32)
    matmul_of(t)(x, t.packed, t.d, t.m, want, threads)
    got = np.full((-(-rows // GROUP) * GROUP, want.shape[1]), np.nan, np.float32)
    chunk_matmul_of(t)(x, t.packed, t.d, t.m, got, threads)
    assert np.array_equal(got[:rows], want)


@pytest.mark.parametrize("kind,in_features", [(Q4_1, 576), (Q4_K, 512), (Q5_0, 576)], ids=str)
def test_a_packed_linear_takes_it_for_long_passes_and_keeps_each_rows_bits(
    kind, in_features
) -> None:
    blocks = random_blocks(96, in_features, seed=5, kind=kind)
    layer = PackedLinear(
        tiles_from_blocks(blocks, 96, in_features, kind.name), int8_activations=True
    )
    assert layer._chunk_kernel is not None
    x = torch.randn(CHUNK_MIN_ROWS + 3, in_features, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    assert together.shape == (CHUNK_MIN_ROWS + 3, 96)
    for row in (0, CHUNK_MIN_ROWS // 2, CHUNK_MIN_ROWS + 2):
        assert torch.equal(layer(x[row : row + 1])[0], together[row])
