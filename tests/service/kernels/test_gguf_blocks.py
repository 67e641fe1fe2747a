"""Every GGUF block type the packed kernels serve (`service/kernels/gguf_blocks.py`): its
weights re-laid exactly as gguf-py dequantizes them, a linear's output against a float64
reference, rows independent of the pass size; and a tiny Llama whose GGUF mixes types as
llama.cpp's Q4_K_M preset does, packed where a type is served and float32 where not, decoding
speculatively exactly as it decodes plainly."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch

from drafting import TableSlot
from service.engine.params import GenerationParams
from service.kernels.gguf_blocks import BLOCK_TYPES, BlockType, unpack
from service.kernels.packed_linear import (
    LLAMA_LINEARS,
    PackedLinear,
    dequantize_tiles,
    load_kernels,
    pack_gguf_linears,
    tiles_file_name,
    tiles_from_blocks,
)
from service.model.runner import ModelRunner
from service.model.tables import compute_tables
from tests.helpers.batch import LENGTHS, MODES, PROMPTS
from tests.helpers.engines import make_engine
from tests.helpers.kernels import needs_numba
from tests.helpers.models import make_tiny_model
from tests.helpers.packed import (
    MIXED_HIDDEN,
    Q6_K,
    UNSERVED,
    assert_linear_matches_reference,
    assert_speculation_equals_plain_decoding,
    mixed_type,
    random_blocks,
    tiny_mixed_twins,
    write_tiny_gguf,
)

kernels = load_kernels()
TYPES = [gguf.GGMLQuantizationType[name] for name in BLOCK_TYPES]


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_every_type_is_relaid_as_ggufs_dequantization_bit_for_bit(kind) -> None:
    blocks = random_blocks(70, 512, seed=1, kind=kind)
    tiles = tiles_from_blocks(blocks, 70, 512, kind.name)
    assert tiles.kind == BLOCK_TYPES[kind.name].layout
    want = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    assert torch.equal(dequantize_tiles(tiles), want)
    if kernels is not None:
        assert torch.equal(PackedLinear(tiles, kernels).dequantized(), want)


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("out_features, in_features", [(45, 256), (200, 768)])
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
def test_a_linear_of_every_type_matches_the_float64_reference(
    use_numba, kind, out_features, in_features, rows
) -> None:
    assert_linear_matches_reference(
        kind, out_features, in_features, rows, kernels if use_numba else None
    )


@needs_numba
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_a_rows_result_does_not_depend_on_the_pass_size(kind) -> None:
    blocks = random_blocks(96, 512, seed=2, kind=kind)
    # every pass in the kernels (by default those above 64 rows may take F.linear, as measured)
    layer = PackedLinear(tiles_from_blocks(blocks, 96, 512, kind.name), kernels, 8, False, 128)
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(0, 128, 9)])
    for rows in (2, 4, 16, 64, 128):
        together = layer(x[:rows])
        assert torch.equal(together[::9], alone[: len(range(0, rows, 9))]), rows


def test_a_type_the_kernels_do_not_serve_is_named() -> None:
    with pytest.raises(ValueError, match=f"unsupported block type {UNSERVED.name}"):
        unpack(UNSERVED.name, random_blocks(4, 256, kind=UNSERVED), 4, 256)


@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory):
    """The mixed-type tiny Llama as float32 and packed: every linear but the IQ4_NL one."""
    plain, packed, path = tiny_mixed_twins(tmp_path_factory.mktemp("gguf"))
    assert pack_gguf_linears(packed, path) == 2 * len(LLAMA_LINEARS) - 1 + 1  # and the LM head
    return plain, packed, path


def test_a_mixed_file_packs_each_served_type_and_keeps_the_rest_float32(tiny_mixed) -> None:
    plain, packed, _ = tiny_mixed
    for index, layer in enumerate(packed.model.layers):
        for kind, name in LLAMA_LINEARS.items():
            module = layer.get_submodule(name)
            weight = plain.model.layers[index].get_submodule(name).weight
            if mixed_type(index, kind) == UNSERVED:
                assert isinstance(module, torch.nn.Linear)
                assert torch.equal(module.weight, weight)
            else:
                assert isinstance(module, PackedLinear)
                assert torch.equal(module.dequantized(), weight)
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.kind == "Q8_0"
    ids = torch.randint(64, (1, 12))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_types_left_as_loaded_are_logged(tiny_mixed, caplog) -> None:
    plain, _, path = tiny_mixed
    again = make_tiny_model(seed=3, hidden_size=MIXED_HIDDEN)
    again.load_state_dict(plain.state_dict())
    with caplog.at_level(logging.INFO, logger="service.kernels.packed_linear"):
        pack_gguf_linears(again, path)
    assert "left as loaded (float32): 1 IQ4_NL" in caplog.text
    assert "1 Q2_K + 2 Q4_0 + 5 Q4_K + 2 Q5_0 + 1 Q5_1 + 1 Q5_K + 1 Q6_K + 1 Q8_0" in caplog.text


def test_a_file_without_a_served_type_is_refused_naming_the_way_out(tmp_path) -> None:
    model = make_tiny_model(seed=3, hidden_size=MIXED_HIDDEN)
    path = tmp_path / "tiny.IQ4_NL.gguf"
    write_tiny_gguf(model, path, linear_type=lambda index, kind: UNSERVED, head_type=UNSERVED)
    with pytest.raises(ValueError, match="no linear weights of a packed type.*--quantization none"):
        pack_gguf_linears(model, path)


def test_speculation_on_a_mixed_file_equals_its_plain_decoding(tiny_mixed) -> None:
    assert_speculation_equals_plain_decoding(tiny_mixed[1])


def test_mixed_rows_batched_with_other_requests_equal_each_request_alone(tiny_mixed) -> None:
    _, packed, _ = tiny_mixed
    runner = ModelRunner(packed)
    tables = TableSlot(compute_tables(packed, batch_size=16, show_progress=False))
    engine = make_engine(runner, tables)
    requests = [(p, GenerationParams(n, speculation=m)) for p, n, m in zip(PROMPTS, LENGTHS, MODES)]
    together = engine.complete_many(requests)
    for (prompt, params), completion in zip(requests, together):
        alone = engine.complete(prompt, GenerationParams(params.max_new_tokens))
        assert completion.token_ids == alone.token_ids


def test_a_mixed_file_loads_by_default_packed_and_decodes_as_float32(tmp_path) -> None:
    """Through the loader, as `ngrammys serve --model tiny.Q4_K_M.gguf` loads it: the default
    quantization packs the served types (a preset's file no longer needs `--quantization
    none`), and greedy decoding equals the float32 model's (these tiny weights have no near
    ties)."""
    from service.model.loader import load_model

    path = tmp_path / "tiny.Q4_K_M.gguf"
    plain = make_tiny_model(seed=3, hidden_size=MIXED_HIDDEN)
    write_tiny_gguf(plain, path, loadable=True, linear_type=mixed_type, head_type=Q6_K)
    packed = load_model(path, cache_dir=tmp_path / "cache").model
    unpacked = load_model(
        path, cache_dir=tmp_path / "cache", quantization="none", dtype="float32"
    ).model
    for index, layer in enumerate(packed.model.layers):
        for kind, name in LLAMA_LINEARS.items():
            served = layer.get_submodule(name)
            assert isinstance(served, PackedLinear) != (mixed_type(index, kind) == UNSERVED), name
    assert isinstance(packed.lm_head, PackedLinear)  # Q6_K
    ids = torch.tensor([[0, 5, 9, 5, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, unpacked(ids).logits, rtol=1e-4, atol=1e-4)
        for model in (packed, unpacked):
            model.generation_config.pad_token_id = 1
        assert torch.equal(
            packed.generate(ids, max_new_tokens=12, do_sample=False),
            unpacked.generate(ids, max_new_tokens=12, do_sample=False),
        )


def test_the_tiles_cache_is_named_by_the_types_served(monkeypatch) -> None:
    """Tiles saved before a type was served (its linears float32 then) are not read after."""
    name = tiles_file_name()
    monkeypatch.setitem(BLOCK_TYPES, "IQ4_NL", BlockType(32, 18, "Q4_1"))
    assert tiles_file_name() != name
