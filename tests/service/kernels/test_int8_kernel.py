"""Packed linears with 8-bit activations (`--quantization gguf-int8`): the kernel of each
instruction set the CPU has against a reference that quantizes the activations the same way,
a row's result whatever the pass holds, and losslessness of speculation on that path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from drafting import TableSlot
from service.controller.profiler import profile_path
from service.engine.params import GenerationParams, SpeculationParams
from service.kernels import int8_kernel
from service.kernels.int8_kernel import (
    AVX2,
    BLOCK,
    VNNI,
    int8_tiles,
    matmul_of,
    supported_isas,
)
from service.kernels.packed_linear import (
    LLAMA_LINEARS,
    PackedLinear,
    dequantize_tiles,
    fuse_packed,
    pack_gguf_linears,
    tiles_from_blocks,
)
from service.model.runner import ModelRunner, RowInput
from service.model.tables import compute_tables
from service.model.tree import chain_tree
from tests.helpers.batch import LENGTHS, MODES, PROMPTS
from tests.helpers.embedded import QUESTIONS, compare
from tests.helpers.engines import make_engine
from tests.helpers.kernels import needs_int8
from tests.helpers.models import make_tiny_model
from tests.helpers.packed import (
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    assert_speculation_equals_plain_decoding,
    random_blocks,
    reference,
    tiny_mixed_twins,
)

pytestmark = needs_int8
ISAS = pytest.mark.parametrize("isa", supported_isas(), ids=lambda isa: isa.name)


def quantized(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel rounds them: per row and block of 32, scale max|x| / 127,
    round half away from zero."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1), 0)
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q.clamp(-127, 127) * scale).reshape(x.shape)


def run(
    kind, blocks: np.ndarray, out_features: int, x: torch.Tensor, chunks: int = 2, isa=None
) -> torch.Tensor:
    tiles = tiles_from_blocks(blocks, out_features, x.shape[1], kind.name)
    t = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, out_features, isa)
    out = np.empty((x.shape[0], t.padded_features), np.float32)
    matmul_of(t)(x.numpy(), t.packed, t.d, t.m, out, chunks)
    return torch.from_numpy(out[:, :out_features])


@ISAS
@pytest.mark.parametrize("kind", [Q4_1, Q5_0, Q5_1, Q8_0])
@pytest.mark.parametrize(
    "out_features,in_features,rows", [(70, 96, 1), (32, 64, 3), (100, 576, 16), (48, 1536, 70)]
)
def test_the_kernel_computes_the_files_weights_on_the_rounded_activations(
    kind, out_features, in_features, rows, isa
) -> None:
    blocks = random_blocks(out_features, in_features, seed=rows, kind=kind)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = run(kind, blocks, out_features, x, isa=isa)
    torch.testing.assert_close(got, reference(blocks, quantized(x), kind), rtol=1e-5, atol=1e-5)
    exact = reference(blocks, x, kind)  # float activations: within the rounding of 8 bits
    assert (got - exact).norm() < 0.02 * exact.norm()


@ISAS
@pytest.mark.parametrize("kind", [Q3_K, Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize(
    "out_features,in_features,rows", [(70, 256, 1), (40, 512, 5), (24, 768, 70)]
)
def test_a_k_quant_computes_its_weights_on_the_rounded_activations(
    out_features, in_features, rows, kind, isa
) -> None:
    """Q6_K's and Q3_K's weights are int16 integers (scale·q) times d, re-laid as a few bits
    times a scale a 16 and d a super-block; Q4_K's and Q5_K's are nibbles or bytes with a scale
    and a min a 32, each a byte times a float a super-block."""
    blocks = random_blocks(out_features, in_features, seed=rows, kind=kind)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = run(kind, blocks, out_features, x, isa=isa)
    torch.testing.assert_close(got, reference(blocks, quantized(x), kind), rtol=1e-5, atol=1e-5)
    together, alone = run(kind, blocks, out_features, x, isa=isa), []
    for row in range(min(rows, 4)):
        alone.append(run(kind, blocks, out_features, x[row : row + 1], chunks=0, isa=isa)[0])
        assert torch.equal(alone[-1], together[row])


@ISAS
@pytest.mark.parametrize("kind", [Q3_K, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, Q6_K])
def test_a_rows_result_does_not_depend_on_the_pass(kind, isa) -> None:
    """Passes of 2, 3, 6 and 9 rows go through every row group (4, 3, 2, alone)."""
    blocks = random_blocks(96, 256, kind=kind)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    alone = [run(kind, blocks, 96, x[row : row + 1], chunks=0, isa=isa)[0] for row in range(9)]
    for rows in (2, 3, 6, 9):
        together = run(kind, blocks, 96, x[:rows], chunks=2, isa=isa)
        for row in range(rows):
            assert torch.equal(alone[row], together[row])
    x[:, :BLOCK] = 0  # an all-zero block: scale 0, no division by it
    assert torch.isfinite(run(kind, blocks, 96, x, isa=isa)).all()


@pytest.mark.parametrize("kind", [Q3_K, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, Q6_K])
def test_the_instruction_sets_compute_the_same_bits(kind) -> None:
    """AVX2 and VNNI reach the same exact integer sums, then take the same float steps. The
    extremes are where AVX2's int16 pairs would saturate if summed unguarded: 15·127 nibble
    products, and Q8_0's -128 weights against -127 activations."""
    isas = supported_isas()
    if len(isas) < 2:
        pytest.skip(f"the CPU has one instruction set of the kernel's: {isas[0].name}")
    blocks = random_blocks(64, 256, seed=4, kind=kind)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    x[0] = torch.where(torch.arange(256) % 32 == 0, -1.0, -1e-3)  # xq: -127 and small
    results = [run(kind, blocks, 64, x, isa=isa) for isa in isas]
    assert all(torch.equal(results[0], other) for other in results[1:])


@ISAS
def test_q6_k_sub_blocks_with_common_factors_or_zero_scales_compute_their_weights(isa) -> None:
    """Q6_K is re-laid as 6-bit weights times a per-16 scale: the products' greatest common
    divisor, not the file's scale. Blocks whose scales share factors with their weights, and
    all-zero groups, included."""
    blocks = random_blocks(48, 512, seed=6, kind=Q6_K)
    per_block = blocks.reshape(48, 2, -1)
    per_block[:8, :, :192] = 0x22  # q = 2 | 2<<4 ... (even weights minus 32: common factors)
    per_block[8:12, :, 192:208] = 0  # scale 0: all-zero products
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(6))
    got = run(Q6_K, blocks, 48, x, isa=isa)
    torch.testing.assert_close(got, reference(blocks, quantized(x), Q6_K), rtol=1e-5, atol=1e-5)
    tiles = tiles_from_blocks(blocks, 48, 512, "Q6_K")
    relaid = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 48, isa)
    # 6 bits a weight and an int8 scale a 16: the file's 0.82 bytes a weight, d a super-block
    assert relaid.packed.shape[2] == 6 * isa.vector_bytes + 2 * isa.columns


@ISAS
def test_q3_k_as_four_bits_and_as_six_gives_the_same_bits(isa, monkeypatch) -> None:
    """Q3_K's products scale·(q - 4) factor into 4-bit weights (kind "Q3_K", two thirds of
    6-bit's bytes) and Q6_K's into 6-bit ones; the sums are the same integers either way, so
    the outputs are the same bits. A weight with one sub-block that needs 6 bits takes 6 bits
    throughout."""
    blocks = random_blocks(48, 512, seed=7, kind=Q3_K)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(7))
    tiles = tiles_from_blocks(blocks, 48, 512, "Q3_K")
    assert int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 48, isa).kind == "Q3_K"
    six = tiles.qs.copy()
    six[0, 0, :16, 0] = 9 * np.arange(16)  # products whose gcd 9 leaves w up to 15: 6 bits
    assert int8_tiles(tiles.kind, six, tiles.d, tiles.m, 48, isa).kind == "Q6_K"
    four = run(Q3_K, blocks, 48, x, isa=isa)
    monkeypatch.setattr(int8_kernel, "_scaled_kind", lambda qs: "Q6_K")
    assert torch.equal(four, run(Q3_K, blocks, 48, x, isa=isa))
    torch.testing.assert_close(four, reference(blocks, quantized(x), Q3_K), rtol=1e-5, atol=1e-5)


@ISAS
def test_q5_0_as_five_bits_and_as_eight_gives_the_same_bits(isa, monkeypatch) -> None:
    """Q5_0's weights (re-laid as Q8_0's int8 by `gguf_blocks`) all fit [-16, 15]: the 8-bit
    path takes them as 5 bits (w + 16, as Q8_1's q) with each sum starting from -16·Σxq, 0.75
    bytes a weight where int8 took 1.125, and computes the same integers; a Q8_0 file's stay
    8-bit."""
    blocks = random_blocks(48, 512, seed=8, kind=Q5_0)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(8))
    tiles = tiles_from_blocks(blocks, 48, 512, "Q5_0")
    five = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 48, isa)
    assert (five.kind, five.m.size) == ("Q5_0", 0)
    eight_bit = tiles_from_blocks(random_blocks(48, 512, seed=8, kind=Q8_0), 48, 512, "Q8_0")
    assert int8_tiles("Q8_0", eight_bit.qs, eight_bit.d, eight_bit.m, 48, isa).kind == "Q8_0"
    got = run(Q5_0, blocks, 48, x, isa=isa)
    monkeypatch.setattr(int8_kernel, "_fits_5_bits", lambda qs: False)
    eight = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 48, isa)
    assert eight.kind == "Q8_0" and eight.packed.nbytes > five.packed.nbytes
    assert torch.equal(got, run(Q5_0, blocks, 48, x, isa=isa))


@ISAS
@pytest.mark.parametrize("kind", [Q3_K, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, Q6_K])
def test_extreme_weights_and_activations_do_not_saturate(kind, isa) -> None:
    """Every weight at its type's extreme (a nibble of 15; Q5_1's and Q5_K's q of 31, Q5_0's
    31 - 16; an int8 of -128; Q6_K's -128·(0 - 32), Q3_K's -32·(0 - 4))
    against activations of ±127 after rounding: the sums must be the exact ones, on AVX2 too,
    where products are summed in int16."""
    blocks = random_blocks(16, 256, seed=2, kind=kind)
    per_block = blocks.reshape(
        16, 256 // 32 if kind in (Q4_1, Q5_0, Q5_1, Q8_0) else 1, -1
    )  # [rows, blocks, bytes]
    if kind is Q4_1 or kind is Q5_1:
        per_block[..., 4:] = 0xFF  # every nibble 15 and high bit set (after d and m)
    elif kind is Q5_0:
        per_block[..., 2:] = 0xFF  # (after d)
    elif kind is Q5_K or kind is Q4_K:
        per_block[..., 16:] = 0xFF  # (after d, dmin, the scales and mins)
    elif kind is Q8_0:
        per_block[..., 2:] = np.int8(-128).view(np.uint8)  # (after d)
    elif kind is Q3_K:
        per_block[..., :96] = 0  # q = 0: q - 4 = -4 (high bits clear, low bits 0)
        per_block[..., 96:108] = 0  # every scale 0 - 32 = -32: products of 128
    else:
        per_block[..., :192] = 0  # q = 0: q - 32 = -32 (before the scales and d)
        per_block[..., 192:208] = np.int8(-128).view(np.uint8)
    for sign in (1.0, -1.0):
        x = torch.full((1, 256), sign)
        got = run(kind, blocks, 16, x, isa=isa)
        torch.testing.assert_close(got, reference(blocks, x, kind), rtol=1e-5, atol=1e-4)


@ISAS
@pytest.mark.parametrize("kind", [Q4_K, Q5_K])
def test_factored_scales_give_the_bits_of_a_float_a_block(kind, isa, monkeypatch) -> None:
    """Q4_K's and Q5_K's scales and mins are kept as the file has them, a byte a block times a
    float a super-block (0.09 bytes a weight, where a float32 scale and min a block take 0.25),
    and the kernel's d·sc is exact: the outputs are the bits of the unfactored layout's."""
    blocks = random_blocks(40, 768, seed=9, kind=kind)
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(9))
    tiles = tiles_from_blocks(blocks, 40, 768, kind.name)
    factored = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 40, isa)
    assert factored.kind == kind.name and factored.d.shape[1] == 768 // 256
    factored_bytes = factored.packed.nbytes + factored.d.nbytes + factored.m.nbytes
    got = run(kind, blocks, 40, x, isa=isa)
    monkeypatch.setattr(int8_kernel, "_factored_scales", lambda a: None)
    unfactored = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 40, isa)
    assert unfactored.kind == {"Q4_K": "Q4_1", "Q5_K": "Q8_1"}[kind.name]
    assert factored_bytes < unfactored.packed.nbytes + unfactored.d.nbytes + unfactored.m.nbytes
    assert torch.equal(got, run(kind, blocks, 40, x, isa=isa))


@ISAS
@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q6_K])
def test_a_files_float16_scales_stay_float16_with_the_same_bits(kind, isa, monkeypatch) -> None:
    """Scales (and mins) that are all float16, as a file's are, are kept in two bytes and
    widened exactly in the kernel: the bits of float32 scales."""
    blocks = random_blocks(40, 512, seed=10, kind=kind)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(10))
    tiles = tiles_from_blocks(blocks, 40, 512, kind.name)
    half = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 40, isa)
    assert half.half_scales and half.d.itemsize == 2
    got = run(kind, blocks, 40, x, isa=isa)
    monkeypatch.setattr(int8_kernel, "_half_exact", lambda a: False)
    assert not int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 40, isa).half_scales
    assert torch.equal(got, run(kind, blocks, 40, x, isa=isa))
    monkeypatch.undo()
    scaled = tiles.d * np.float32(1 + 2**-20)  # a float32 past float16's bits: kept float32
    assert not int8_tiles(tiles.kind, tiles.qs, scaled, tiles.m, 40, isa).half_scales


def test_scales_factor_only_as_exact_products_of_a_byte() -> None:
    """A super-block's values factor into s·f (f a byte) exactly, or not at all: mixed signs,
    unrelated floats and factors past a byte stay a float a block."""
    rng = np.random.default_rng(0)
    d = rng.standard_normal((2, 3, 1, 32)).astype(np.float16).astype(np.float32)
    values = np.abs(d) * rng.integers(0, 64, (2, 3, 8, 32)).astype(np.float32)
    s, f = int8_kernel._factored_scales(values.reshape(2, 24, 32))
    assert np.array_equal(np.repeat(s, 8, axis=1) * f.astype(np.float32), values.reshape(2, 24, 32))
    assert int8_kernel._factored_scales(-values.reshape(2, 24, 32)) is not None
    assert int8_kernel._factored_scales(np.zeros((1, 8, 32), np.float32)) is not None
    mixed = values.reshape(2, 24, 32).copy()
    mixed[0, 0, 0], mixed[0, 1, 0] = 1.0, -1.0
    assert int8_kernel._factored_scales(mixed) is None
    unrelated = rng.standard_normal((1, 8, 32)).astype(np.float32)
    assert int8_kernel._factored_scales(unrelated) is None
    past_a_byte = np.ones((1, 8, 32), np.float32)
    past_a_byte[0, 0] = 256
    assert int8_kernel._factored_scales(past_a_byte) is None
    assert int8_kernel._factored_scales(np.ones((1, 4, 32), np.float32)) is None  # no super-block


@pytest.mark.parametrize("isa", [VNNI, AVX2], ids=lambda isa: isa.name)
@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K])
def test_a_token_reads_about_the_files_bytes(kind, isa) -> None:
    """The 8-bit layouts hold a weight in at most 6% more bytes than the file's blocks (Q4_K's
    and Q5_K's float super-block scales, a float32 where the file's is a float16; Q4_0's and
    Q5_0's weights offset, with no min), so decoding reads what llama.cpp reads."""
    tiles = tiles_from_blocks(random_blocks(64, 1024, seed=3, kind=kind), 64, 1024, kind.name)
    relaid = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, 64, isa)
    held = relaid.packed.nbytes + relaid.d.nbytes + relaid.m.nbytes
    weights, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.name]]
    assert held <= 1.06 * 64 * 1024 / weights * nbytes


@pytest.mark.parametrize("isa", [VNNI, AVX2], ids=lambda isa: isa.name)
@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K])
def test_the_relaid_weights_are_the_files(kind, isa) -> None:
    """Read back from the bytes the kernels of either instruction set take (re-laying needs
    no CPU feature), every weight is the one the file's blocks give: the 8-bit path keeps no
    other copy to check against."""
    tiles = tiles_from_blocks(random_blocks(96, 512, seed=7, kind=kind), 96, 512, kind.name)
    relaid = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, tiles.out_features, isa)
    assert np.array_equal(relaid.dequantized(), dequantize_tiles(tiles).numpy())


@pytest.mark.parametrize("kind", [Q4_1, Q6_K])
def test_fused_layers_share_one_8_bit_relaying(kind) -> None:
    """q, k, v as one layer on the 8-bit path: each layer then computes from a view of the fused
    layer's re-laid tiles (not a copy of its own), with the bits it had alone."""
    shapes = [(96, 512), (32, 512), (64, 512)]
    layers = [
        PackedLinear(
            tiles_from_blocks(random_blocks(o, i, seed=o, kind=kind), o, i, kind.name),
            int8_activations=True,
        )
        for o, i in shapes
    ]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = fuse_packed(layers)
    assert fused is not None and torch.equal(fused(x), alone)
    assert torch.equal(torch.cat([layer(x) for layer in layers], dim=-1), alone)
    assert all(np.shares_memory(layer._int8.packed, fused._int8.packed) for layer in layers)
    for layer in [fused, *layers]:  # the re-laid tiles only: no float-path tiles beside them
        with pytest.raises(ValueError, match="only its re-laid tiles"):
            layer.tiles()


def test_every_packed_linear_computes_with_8_bit_activations(tiny_int8) -> None:
    plain, packed, _ = tiny_int8
    for name, module in packed.named_modules():
        if name.endswith((*LLAMA_LINEARS.values(), "lm_head")):
            assert isinstance(module, PackedLinear) and "int8" in module.extra_repr()
            assert torch.equal(
                module.dequantized(), plain.get_submodule(name).weight
            )  # the file's weights
            x = torch.randn(5, module.in_features)
            torch.testing.assert_close(
                module(x), quantized(x) @ module.dequantized().T, rtol=1e-5, atol=1e-5
            )


def test_a_mixed_file_computes_every_served_type_with_8_bit_activations(tmp_path) -> None:
    """A Q4_K_M-like file (Q2_K, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0; one IQ4_NL linear,
    not served) packs every served type on the 8-bit path, Q6_K's int16 weights too, Q4_K's
    and Q5_K's scales factored, Q5_0's weights as 5 bits, but Q2_K's (no 8-bit kernel takes
    its half-block mins: float32 activations there); speculation there equals plain
    decoding."""
    plain, packed, path = tiny_mixed_twins(tmp_path)
    assert pack_gguf_linears(packed, path, int8_activations=True) == 2 * len(LLAMA_LINEARS)
    kinds = set()
    for name, module in packed.named_modules():
        if isinstance(module, PackedLinear):
            assert torch.equal(module.dequantized(), plain.get_submodule(name).weight)
            x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(3))
            if module.kind == "Q8_1_16":
                assert not module.int8_activations
                torch.testing.assert_close(module(x), x @ module.dequantized().T)
                continue
            kinds.add(module._int8.kind)
            torch.testing.assert_close(
                module(x), quantized(x) @ module.dequantized().T, rtol=1e-5, atol=1e-5
            )
    assert kinds == {"Q4_0", "Q4_K", "Q5_0", "Q8_0", "Q8_1", "Q5_K", "Q6_K"}
    assert_speculation_equals_plain_decoding(packed)


def test_its_kv_cache_holds_float16_and_counts_half_the_bytes(tiny_int8) -> None:
    """The 8-bit path keeps keys and values in float16 (llama.cpp's default), and the
    scheduler's memory budget counts what they take."""
    plain, packed, _ = tiny_int8
    runner, floats = ModelRunner(packed), ModelRunner(plain)
    assert runner.kv_dtype == torch.float16 and floats.kv_dtype == torch.float32
    assert runner.kv_bytes_per_token * 2 == floats.kv_bytes_per_token
    cache = runner.new_cache(1)
    runner.forward(cache, [RowInput(chain_tree([3, 5, 7]))])
    assert cache.layers[0].keys.dtype == torch.float16 and cache.nbytes == cache.layers[
        0
    ].keys.nbytes * 2 * len(cache.layers)


def test_its_cost_profile_is_not_the_float_activations_one(tiny_int8, tmp_path) -> None:
    plain, packed, path = tiny_int8
    floats = make_tiny_model(seed=3)
    floats.load_state_dict(plain.state_dict())
    pack_gguf_linears(floats, path)  # the same buffers, float activations
    assert profile_path(tmp_path, ModelRunner(packed)) != profile_path(
        tmp_path, ModelRunner(floats)
    )


def test_speculation_on_the_int8_path_equals_its_plain_decoding(tiny_int8) -> None:
    assert_speculation_equals_plain_decoding(tiny_int8[1])


def test_int8_rows_batched_with_other_requests_equal_each_request_alone(tiny_int8) -> None:
    """Prompt chunks of any size and trees beside other requests' rows: the int8 kernel runs
    every pass size, so each request gets what it gets alone."""
    _, packed, _ = tiny_int8
    engine = make_engine(
        ModelRunner(packed), TableSlot(compute_tables(packed, batch_size=16, show_progress=False))
    )
    requests = [(p, GenerationParams(n, speculation=m)) for p, n, m in zip(PROMPTS, LENGTHS, MODES)]
    together = engine.complete_many(requests)
    for (prompt, params), completion in zip(requests, together):
        assert (
            completion.token_ids
            == engine.complete(prompt, GenerationParams(params.max_new_tokens)).token_ids
        )


@pytest.mark.slow
def test_embedded_int8_speculation_equals_its_plain_decoding() -> None:
    from service.model.loader import load_model
    from service.model.prompts import chat_prompt_ids
    from service.runtime import build_engine

    loaded = load_model(quantization="gguf-int8")
    engine = build_engine(loaded, TableSlot())
    outcomes: dict[str, int] = {}
    for question in QUESTIONS:
        prompt = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": question}])
        plain = engine.complete(prompt, GenerationParams(max_new_tokens=48)).token_ids
        for k, w in ((1, 1), (4, 4), (8, 6)):
            params = GenerationParams(
                max_new_tokens=48, speculation=SpeculationParams(k, w), strategy="context"
            )
            outcome = compare(
                loaded.model, prompt, engine.complete(prompt, params).token_ids, plain
            )
            assert outcome in ("identical", "tie"), f"{question!r} k={k} w={w}: {outcome}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\nint8 path, speculative vs plain: {outcomes}")
    assert outcomes.get("identical", 0) >= 0.9 * sum(outcomes.values())
