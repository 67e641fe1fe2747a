"""The 8-bit linears' kernel for passes of many rows (`service/kernels/int8_chunk_kernel.py`):
the same bits as the kernel of every pass size, whatever the rows, threads and shapes, so a
decode row batched with a prompt chunk gets what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.kernels.int8_chunk_kernel import CHUNK_MIN_ROWS, GROUP, chunk_matmul
from service.kernels.int8_kernel import (
    BLOCK,
    int8_matmul,
    int8_tiles,
    supported_isas,
)
from service.kernels.packed_linear import PackedLinear, tiles_from_blocks
from tests.helpers.kernels import needs_int8
from tests.helpers.packed import random_blocks

pytestmark = needs_int8


def tiles(out_features: int, in_features: int, seed: int, isa):
    t = tiles_from_blocks(
        random_blocks(out_features, in_features, seed=seed), out_features, in_features
    )
    return int8_tiles("Q4_1", t.qs, t.d, t.m, out_features, isa)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 100])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (70, 96), (96, 576), (48, 1536)])
@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("isa", supported_isas(), ids=lambda isa: isa.name)
def test_the_chunk_kernel_gives_the_every_size_kernels_bits(
    rows, out_features, in_features, threads, isa
) -> None:
    t = tiles(out_features, in_features, seed=rows, isa=isa)
    # rows of unlike ranges
    scale = torch.rand(rows, 1, generator=torch.Generator().manual_seed(rows)) * 8
    x = (
        torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows + 1)) * scale
    ).numpy()
    x[0, :BLOCK] = 0  # an all-zero block: scale 0
    want = np.empty((rows, t.padded_features), np.float32)
    int8_matmul("Q4_1", isa)(x, t.packed, t.d, t.m, want, threads)
    got = np.full((-(-rows // GROUP) * GROUP, want.shape[1]), np.nan, np.float32)
    chunk_matmul(isa)(x, t.packed, t.d, t.m, got, threads)
    assert np.array_equal(got[:rows], want)


def test_a_packed_linear_takes_it_for_long_passes_and_keeps_each_rows_bits() -> None:
    blocks = random_blocks(96, 576, seed=5)
    layer = PackedLinear(tiles_from_blocks(blocks, 96, 576), int8_activations=True)
    x = torch.randn(CHUNK_MIN_ROWS + 3, 576, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    assert together.shape == (CHUNK_MIN_ROWS + 3, 96)
    for row in (0, CHUNK_MIN_ROWS // 2, CHUNK_MIN_ROWS + 2):
        assert torch.equal(layer(x[row : row + 1])[0], together[row])
