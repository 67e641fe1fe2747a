"""Sliding-window attention (service/model/attention.py): models whose layers see only the
last W positions, served past their window. Greedy output equals transformers' own decoding
(a twin model transformers' own attention runs, windows and all) with speculation off, fixed
and auto, batched and alone; tree logits equal decoding each path token by token, on the float
path, the packed one and the 8-bit one; the prefix cache changes nothing."""

from __future__ import annotations

import pytest
import torch

from drafting import TableSlot
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.kernels.packed_linear import load_kernels, pack_gguf_linears
from service.model.attention import layer_windows
from service.model.prefix_cache import BLOCK_TOKENS
from service.model.runner import ModelRunner, RowInput
from service.model.tables import compute_tables
from service.model.tree import build_tree
from tests.helpers.engines import assert_decodes_as, make_engine, reference_greedy
from tests.helpers.kernels import needs_int8
from tests.helpers.models import make_tiny_family_model
from tests.helpers.packed import assert_speculation_equals_plain_decoding, write_tiny_gguf
from tests.helpers.passes import DRAFTS, assert_nodes_match, prefilled

load_kernels()
WINDOW = 12
# Mistral and Phi-3: every layer windowed; Qwen2: layers past max_window_layers; Gemma 3: its
# local layers
FAMILIES = {
    "MistralConfig": {"sliding_window": WINDOW},
    "Qwen2Config": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    "Gemma3TextConfig": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "Phi3Config": {"sliding_window": WINDOW, "pad_token_id": 0},  # every layer, as Mistral's
}
PROMPT = [5, 9, 13, 2, 7, 7, 30, 41, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 22, 17, 9, 13, 2, 7, 7]
OTHER = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
NEW_TOKENS = 24


def twins(config_name: str):
    """The model to serve and its untouched twin (the same weights) that transformers' own
    attention runs, windows applied by its masks."""
    served, reference = (
        make_tiny_family_model(config_name, seed=5, **FAMILIES[config_name]) for _ in range(2)
    )
    return served, reference


def engine_for(model) -> Engine:
    tables = TableSlot(compute_tables(model, batch_size=16, show_progress=False))
    return make_engine(ModelRunner(model), tables)


@pytest.mark.parametrize("config_name", FAMILIES)
def test_layers_take_the_windows_transformers_applies(config_name) -> None:
    served, _ = twins(config_name)
    windows = layer_windows(served.config)
    every_layer = config_name in ("MistralConfig", "Phi3Config")
    assert WINDOW in windows and every_layer == (None not in windows)


@pytest.mark.parametrize("config_name", FAMILIES)
def test_greedy_output_past_the_window_equals_transformers_decoding(config_name) -> None:
    served, reference = twins(config_name)
    want = {tuple(p): reference_greedy(reference, p, NEW_TOKENS) for p in (PROMPT, OTHER)}
    engine = engine_for(served)
    for speculation in (
        SpeculationParams(),
        SpeculationParams(2, 2),
        SpeculationParams(4, 3),
        SpeculationParams(6, 5, mode="auto"),
    ):
        params = GenerationParams(max_new_tokens=NEW_TOKENS, speculation=speculation)
        alone = engine.complete(PROMPT, params).token_ids
        assert alone == want[tuple(PROMPT)], speculation
        batched = engine.complete_many([(PROMPT, params), (OTHER, params)])
        assert [r.token_ids for r in batched] == [want[tuple(PROMPT)], want[tuple(OTHER)]]


@pytest.mark.parametrize("config_name", FAMILIES)
def test_tree_nodes_past_the_window_equal_sequential_decoding(config_name) -> None:
    served, reference = twins(config_name)
    runner = ModelRunner(served)
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    assert_nodes_match(reference, PROMPT, tree, runner.forward(cache, [RowInput(tree)])[0])


@pytest.mark.parametrize("config_name", ["MistralConfig", "Gemma3TextConfig", "Phi3Config"])
@pytest.mark.parametrize(
    "int8", [False, pytest.param(True, marks=needs_int8)], ids=["gguf", "gguf-int8"]
)
def test_packed_windowed_layers_attend_through_the_kernel_within_the_window(
    config_name, int8, tmp_path
) -> None:
    """The packed path's attention kernel (every row on the 8-bit path) with windows: Mistral's
    and Phi-3's on every layer (Phi-3's fused projections packed as they are), Gemma 3's on its
    local ones (its norms and rotary tables per layer)."""
    served, reference = twins(config_name)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(reference, path)  # the reference now holds the file's weights
    served.load_state_dict(reference.state_dict())
    pack_gguf_linears(served, path, int8_activations=int8)
    runner = ModelRunner(served)
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    logits = runner.forward(cache, [RowInput(tree)])[0]
    # the 8-bit path rounds its activations: within 0.02 here, where attending past the window
    # (densely) is 0.17 off
    assert_nodes_match(reference, PROMPT, tree, logits, 0.02 if int8 else 1e-4)
    assert_speculation_equals_plain_decoding(served)


@pytest.mark.parametrize("quantization", ["gguf", pytest.param("gguf-int8", marks=needs_int8)])
def test_a_gemma_3_gguf_serves_packed_as_transformers_runs_the_file(quantization, tmp_path) -> None:
    """A Gemma 3 GGUF as llama.cpp writes one (norms stored as 1 + weight, the tied embedding
    quantized, no output tensor) through the loader: packed linears, the embedding kept packed
    and scaled by √hidden as Gemma's, the attention scale the head size's as llama.cpp derives
    it. On the float-activation path greedy output past the window equals transformers' own
    model of the file (given that scale: its GGUF loading keeps its class's 1/sqrt(256)), with
    speculation off, fixed and auto, batched and alone; the 8-bit path's speculation equals its
    plain decoding."""
    from transformers import AutoModelForCausalLM

    from service.kernels.packed_embedding import PackedEmbedding
    from service.model.loader import load_model

    model = make_tiny_family_model("Gemma3TextConfig", seed=5, **FAMILIES["Gemma3TextConfig"])
    write_tiny_gguf(model, tmp_path / "gemma3.gguf", loadable=True)  # model: the file's weights
    loaded = load_model(tmp_path / "gemma3.gguf", cache_dir=tmp_path, quantization=quantization)
    served = loaded.model
    embedding = served.get_input_embeddings()
    assert isinstance(embedding, PackedEmbedding) and float(embedding.scale) == 64**0.5
    assert None not in layer_windows(served.config)  # llama.cpp's files: windows by pattern
    if quantization == "gguf-int8":
        assert_speculation_equals_plain_decoding(served)
        return
    assert served.config.query_pre_attn_scalar == model.config.query_pre_attn_scalar == 16
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="gemma3.gguf", dtype=torch.float32, query_pre_attn_scalar=16
    ).eval()
    want = {tuple(p): reference_greedy(reference, p, NEW_TOKENS) for p in (PROMPT, OTHER)}
    engine = engine_for(served)
    assert_decodes_as(
        engine,
        want,
        NEW_TOKENS,
        (SpeculationParams(), SpeculationParams(4, 3), SpeculationParams(6, 5, mode="auto")),
    )


def test_a_prompt_from_the_prefix_cache_and_seeded_sampling_decode_as_without() -> None:
    """A prompt read back from the prefix cache (its first block) decodes past the window as
    when computed; seeded sampling draws the same tokens with and without speculation."""
    served, reference = twins("Gemma3TextConfig")
    want = reference_greedy(reference, PROMPT, NEW_TOKENS)
    engine = engine_for(served)
    params = GenerationParams(max_new_tokens=NEW_TOKENS, speculation=SpeculationParams(4, 3))
    assert engine.complete(PROMPT, params).token_ids == want
    assert engine.complete(PROMPT, params).token_ids == want
    assert engine.scheduler.prefix.stats.hit_tokens >= BLOCK_TOKENS
    sampled = [
        engine.complete(
            PROMPT,
            GenerationParams(
                max_new_tokens=NEW_TOKENS,
                speculation=speculation,
                sampling=SamplingParams(temperature=1.0, seed=7),
            ),
        ).token_ids
        for speculation in (SpeculationParams(), SpeculationParams(4, 3))
    ]
    assert sampled[0] == sampled[1] and sampled[0] != want
