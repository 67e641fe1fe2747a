"""Packed Q4_1 linears (`--quantization gguf`): the numba kernel and its torch fallback against
a plain torch reference, the GGUF mapping, and losslessness of speculation on the packed path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from drafting import TableSlot
from service.cache_files import read_checked_json, write_checked_json
from service.engine.params import GenerationParams, SpeculationParams
from service.kernels import packed_kernels_gen
from service.kernels.packed_embedding import PackedEmbedding
from service.kernels.packed_linear import (
    FUSED_ROW_CANDIDATES,
    KERNEL_MAX_ROWS,
    LARGE_PASS_CANDIDATES,
    LLAMA_LINEARS,
    UNBOUNDED_ROWS,
    PackedLinear,
    fuse_packed,
    kernel_max_rows_for,
    load_kernels,
    pack_gguf_linears,
    tiles_from_blocks,
    tune_fused_max_rows,
    tune_kernel_max_rows,
    unpermute_rows,
)
from service.model.decoder_pass import fuse_projections, project
from service.model.runner import ModelRunner
from service.model.tables import compute_tables
from tests.helpers.batch import LENGTHS, MODES, PROMPTS
from tests.helpers.embedded import QUESTIONS, compare
from tests.helpers.engines import make_engine
from tests.helpers.kernels import needs_numba
from tests.helpers.models import make_tiny_model
from tests.helpers.packed import (
    Q4_1,
    Q8_0,
    assert_linear_matches_reference,
    assert_speculation_equals_plain_decoding,
    random_blocks,
    reference,
)

kernels = load_kernels()  # None where numba is missing (those tests skip) or fails (they fail)


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
@pytest.mark.parametrize(
    "out_features, in_features", [(64, 32), (45, 96), (200, 608), (576, 576), (33, 1536)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 16, 33])
def test_packed_linear_matches_the_torch_reference(
    use_numba, kind, out_features, in_features, rows
) -> None:
    """Every row count the two layouts' dispatch tells apart, on odd shapes (every GGUF type's
    weights against gguf-py's: tests/service/kernels/test_gguf_blocks.py)."""
    assert_linear_matches_reference(
        kind, out_features, in_features, rows, kernels if use_numba else None
    )


def test_batched_leading_dims_and_large_passes() -> None:
    blocks = random_blocks(96, 64)
    layer = PackedLinear(tiles_from_blocks(blocks, 96, 64), kernels)
    x = torch.randn(2, KERNEL_MAX_ROWS, 64)  # 128 rows: the dequantize + F.linear path
    got = layer(x)
    assert got.shape == (2, KERNEL_MAX_ROWS, 96)
    torch.testing.assert_close(
        got.reshape(-1, 96), reference(blocks, x.reshape(-1, 64)), rtol=1e-5, atol=2e-5
    )
    torch.testing.assert_close(layer(x[:, :5]), got[:, :5], rtol=1e-5, atol=2e-5)
    with pytest.raises(ValueError, match="64 features, got 128"):
        layer(torch.randn(3, 128))  # as many numbers as 6 rows: refused, not reshaped


@needs_numba
@pytest.mark.parametrize("kind, fused_max_rows", [(Q4_1, 2), (Q4_1, 8), (Q4_1, 32), (Q8_0, 2)])
def test_a_rows_result_does_not_depend_on_the_pass_size(kind, fused_max_rows) -> None:
    """Each output is the same float32 sum in one k order whatever the pass, in registers or
    through the tile buffer: bit-identical rows."""
    blocks = random_blocks(100, 576, kind=kind)
    layer = PackedLinear(tiles_from_blocks(blocks, 100, 576, kind.name), kernels, fused_max_rows)
    x = torch.randn(17, 576)
    together = layer(x)
    for i in range(17):
        assert torch.equal(layer(x[i : i + 1])[0], together[i])
    for rows in range(2, 17):  # groups of four, tails of one, two and three (padded to four)
        assert torch.equal(layer(x[:rows]), together[:rows])
    assert torch.equal(layer(x[3:6]), together[3:6])


@needs_numba
def test_the_q4_1_dispatch_changes_no_bit_and_is_tuned_among_its_candidates() -> None:
    """Dequantizing in registers (four rows at a time) and through the buffer give the same
    bits at every pass size, so the tuned choice can only change speed."""
    tiles = tiles_from_blocks(random_blocks(128, 576), 128, 576)
    x = torch.randn(40, 576)
    buffered = PackedLinear(tiles, kernels, fused_max_rows=2)
    in_registers = PackedLinear(tiles, kernels, fused_max_rows=KERNEL_MAX_ROWS)
    for rows in range(1, 41):
        assert torch.equal(in_registers(x[:rows]), buffered(x[:rows]))
    assert tune_fused_max_rows(
        [tiles, tiles_from_blocks(random_blocks(64, 1536), 64, 1536)], kernels
    ) in (2, *FUSED_ROW_CANDIDATES)


@needs_numba
def test_large_passes_take_the_kernel_or_the_gemm_as_tuned_and_the_kernel_keeps_rows_independent() -> (  # noqa: E501
    None
):
    """Where the CPU measured the kernel faster at large passes, a prompt-sized pass runs it too:
    each row's result is then the same bits as that row alone; through the GEMM it is only close."""
    tiles = tiles_from_blocks(random_blocks(96, 576), 96, 576)
    x = torch.randn(KERNEL_MAX_ROWS + 40, 576)
    kernel = PackedLinear(tiles, kernels, kernel_max_rows=UNBOUNDED_ROWS)
    gemm = PackedLinear(tiles, kernels)  # the least limit: above it, dequantized + F.linear
    together = kernel(x)
    assert all(torch.equal(kernel(x[i : i + 1])[0], together[i]) for i in range(0, len(x), 7))
    torch.testing.assert_close(gemm(x), together, rtol=1e-5, atol=2e-5)
    assert tune_kernel_max_rows([tiles], kernels, fused_max_rows=2) in (
        KERNEL_MAX_ROWS,
        *LARGE_PASS_CANDIDATES,
        UNBOUNDED_ROWS,
    )


@needs_numba
def test_the_large_pass_limit_is_measured_once_per_kind_of_cpu(tmp_path) -> None:
    """Kept in the cache dir: a later start of the same machine reads it, not its own timing."""
    tiles = tiles_from_blocks(random_blocks(96, 576), 96, 576)
    measured = kernel_max_rows_for([tiles], kernels, 2, tmp_path)
    (saved,) = (tmp_path / "tuning").iterdir()
    assert read_checked_json(saved) == {"kernel_max_rows": measured}
    write_checked_json(saved, {"kernel_max_rows": 128})
    assert kernel_max_rows_for([tiles], kernels, 2, tmp_path) == 128


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_fused_layers_compute_each_layers_outputs_from_the_same_memory(use_numba, kind) -> None:
    """q, k, v as one layer (`service/model/decoder_pass.py`): the fused kernel call gives each
    layer's outputs bit for bit (the torch fallback's float32 GEMM may order sums by shape),
    and the layers, now views of the fused tiles, still work."""
    shapes = [(96, 576), (32, 576), (64, 576)]
    layers = [
        PackedLinear(
            tiles_from_blocks(random_blocks(o, i, seed=o, kind=kind), o, i, kind.name),
            kernels if use_numba else None,
            fused_max_rows=8,
        )
        for o, i in shapes
    ]
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = fuse_packed(layers)
    assert fused is not None and fused.out_features == 192 and fused.fused_max_rows == 8
    if use_numba:
        assert torch.equal(fused(x), alone)
    else:
        torch.testing.assert_close(fused(x), alone, rtol=1e-5, atol=1e-5)  # float32 sums, 576 long
    assert torch.equal(torch.cat([layer(x) for layer in layers], dim=-1), alone)
    assert all(np.shares_memory(layer.tiles().qs, fused.tiles().qs) for layer in layers)


@needs_numba
def test_projections_of_mixed_kinds_fuse_in_runs_of_one_kind() -> None:
    """A Q4_K_M file's q and k of one type beside a v of another: q and k become one layer, v
    stays its own, and the outputs side by side are each layer's alone, bit for bit."""
    kinds = [Q4_1, Q4_1, Q8_0]
    layers = [
        PackedLinear(
            tiles_from_blocks(random_blocks(o, 576, seed=o, kind=kind), o, 576, kind.name),
            kernels,
        )
        for o, kind in zip((96, 32, 64), kinds)
    ]
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = fuse_projections(layers)
    assert [layer.out_features for layer in fused] == [128, 64] and fused[1] is layers[2]
    assert torch.equal(project(fused, x), alone)


def test_layers_that_do_not_fill_whole_tiles_are_not_fused() -> None:
    layers = [
        PackedLinear(tiles_from_blocks(random_blocks(o, 64, seed=o), o, 64)) for o in (45, 32)
    ]
    assert fuse_packed(layers) is None


def test_unpermute_rows_matches_transformers_gguf_loader() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for rows, heads in ((576, 9), (192, 3)):
        want = processor._reverse_permute_weights(np.arange(rows)[:, None], heads)[:, 0]
        assert np.array_equal(unpermute_rows(rows, heads), want)


def test_the_kernels_file_is_generated_from_its_generator() -> None:
    assert packed_kernels_gen.TARGET.read_text() == packed_kernels_gen.source()


def test_pack_gguf_linears_swaps_every_linear_and_keeps_the_served_weights(tiny_packed) -> None:
    plain, packed, path, tiles_file = tiny_packed
    for name, module in packed.named_modules():
        if name.endswith((*LLAMA_LINEARS.values(), "lm_head")):
            assert isinstance(module, PackedLinear)
            assert torch.equal(module.dequantized(), plain.get_submodule(name).weight)
    ids = torch.randint(64, (1, 12))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    again = make_tiny_model(seed=3)  # second load: from the saved tiles, same modules
    again.load_state_dict(plain.state_dict())
    assert tiles_file.exists() and pack_gguf_linears(again, path, tiles_file=tiles_file) == 15
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, packed(ids).logits)


def test_an_unwritable_tiles_file_only_costs_the_cache(tiny_packed, tmp_path, monkeypatch) -> None:
    plain, _, path, _ = tiny_packed

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(np, "savez", read_only)
    again = make_tiny_model(seed=3)
    again.load_state_dict(plain.state_dict())
    assert pack_gguf_linears(again, path, tiles_file=tmp_path / "tiles.npz") == 15
    assert list(tmp_path.iterdir()) == []


def test_a_wrong_gguf_is_refused(tiny_packed, tmp_path) -> None:
    _, _, path, _ = tiny_packed
    other = make_tiny_model(seed=4)  # not the weights the file holds
    with pytest.raises(ValueError, match="differ from the loaded weight"):
        pack_gguf_linears(other, path, tiles_file=tmp_path / "tiles.npz")


def test_speculation_on_the_packed_path_equals_its_plain_decoding(tiny_packed) -> None:
    assert_speculation_equals_plain_decoding(tiny_packed[1])


def test_packed_rows_batched_with_other_requests_equal_each_request_alone(tiny_packed) -> None:
    """Continuous batching runs every request's rows (prompt chunks, trees) in one flat pass; the
    packed linears and the packed LM head on the tree nodes must give each request what it gets
    alone (here all passes stay at or under KERNEL_MAX_ROWS, so every linear runs the kernel)."""
    _, packed, _, _ = tiny_packed
    runner = ModelRunner(packed)
    assert isinstance(runner.model.get_output_embeddings(), PackedLinear)
    tables = TableSlot(compute_tables(packed, batch_size=16, show_progress=False))
    engine = make_engine(runner, tables, max_tokens_per_pass=KERNEL_MAX_ROWS)
    requests = [(p, GenerationParams(n, speculation=m)) for p, n, m in zip(PROMPTS, LENGTHS, MODES)]
    together = engine.complete_many(requests)
    for (prompt, params), completion in zip(requests, together):
        assert (
            completion.token_ids
            == engine.complete(prompt, GenerationParams(params.max_new_tokens)).token_ids
        )
    assert engine.cache.nbytes == 0 and engine.cache.num_rows == 0


@pytest.fixture(scope="module")
def embedded_packed(embedded):
    from service.model.loader import load_model

    return load_model(quantization="gguf")


@pytest.mark.slow
def test_real_layers_hold_the_files_weights_and_match_float32(embedded, embedded_packed) -> None:
    float32, packed = embedded.model, embedded_packed.model
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(0))
    for index in (0, 14, 29):
        for name in LLAMA_LINEARS.values():
            module = packed.model.layers[index].get_submodule(name)
            weight = float32.model.layers[index].get_submodule(name).weight
            assert isinstance(module, PackedLinear)
            assert torch.equal(module.dequantized(), weight)
            for rows in (1, 3, 16):
                xs = x[:rows, : module.in_features]
                torch.testing.assert_close(module(xs), F.linear(xs, weight), rtol=1e-4, atol=1e-4)
    head = packed.lm_head  # tied to the Q8_0 token embedding in the file
    assert isinstance(head, PackedLinear) and head.kind == "Q8_0"
    assert torch.equal(head.dequantized(), float32.lm_head.weight)
    embedding = packed.model.embed_tokens  # the file's blocks, rows dequantized on lookup
    assert isinstance(embedding, PackedEmbedding) and embedding.kind == "Q8_0"
    assert torch.equal(embedding.dequantized(), float32.model.embed_tokens.weight)
    torch.testing.assert_close(
        head(x[:5, :576]), F.linear(x[:5, :576], float32.lm_head.weight), rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_embedded_packed_speculation_equals_its_plain_decoding(embedded_packed) -> None:
    """Greedy speculative output equals plain output of the same (packed) path, except where
    plain decoding itself is a numerical tie (attention and the LM head still round by pass
    size)."""
    from service.model.prompts import chat_prompt_ids
    from service.runtime import build_engine

    engine = build_engine(embedded_packed, TableSlot())
    model, tokenizer = embedded_packed.model, embedded_packed.tokenizer
    outcomes: dict[str, int] = {}
    for question in QUESTIONS:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        plain = engine.complete(prompt, GenerationParams(max_new_tokens=48)).token_ids
        for k, w in ((1, 1), (4, 4), (8, 6)):
            params = GenerationParams(
                max_new_tokens=48, speculation=SpeculationParams(k, w), strategy="context"
            )
            outcome = compare(model, prompt, engine.complete(prompt, params).token_ids, plain)
            assert outcome in ("identical", "tie"), f"{question!r} k={k} w={w}: {outcome}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\npacked path, speculative vs plain: {outcomes}")
    assert outcomes.get("identical", 0) >= 0.9 * sum(outcomes.values())
