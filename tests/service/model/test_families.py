"""Model families through the whole loader: a GGUF of each architecture the lean pass takes,
written in the test as llama.cpp writes one, served packed on the lean pass, where its tree
logits equal transformers' own sequential decoding of the same weights, and speculation equals
plain decoding; a Phi-3 one's greedy output equals its model's."""

from __future__ import annotations

import pytest
import transformers

from drafting import TableSlot
from service.kernels.packed_linear import PHI3_LINEARS, PackedLinear, load_kernels
from service.model.loader import load_model
from service.model.runner import ModelRunner, RowInput
from service.model.tables import compute_tables
from service.model.tree import build_tree
from tests.helpers.engines import assert_decodes_as, make_engine, reference_greedy
from tests.helpers.kernels import needs_int8
from tests.helpers.models import make_tiny_family_model
from tests.helpers.packed import assert_speculation_equals_plain_decoding, write_tiny_gguf
from tests.helpers.passes import DRAFTS, PROMPT, assert_nodes_match, prefilled

load_kernels()  # from the source tree's cache, not each test's own cache directory
PHI3 = {"pad_token_id": 0}  # (its default padding token is past a tiny vocabulary)
HALF_ROTARY = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# config fields beyond the shared ones; "Phi3Config:partial": Phi-4-mini's partial rotary
# embedding, on half of each 16-wide head; "Phi3Config:longrope": with its long-context rope
# scaling too, of a factor per rotated frequency pair (the short ones within the original
# context of 64, which the tests' sequences stay in)
FAMILY_FIELDS: dict[str, dict] = {
    "Phi3Config": PHI3,
    "Phi3Config:partial": PHI3 | {"rope_parameters": {"rope_type": "default"} | HALF_ROTARY},
    "Phi3Config:longrope": PHI3
    | {
        "original_max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.25, 2.5, 6.0],
            "long_factor": [1.5, 4.0, 9.0, 30.0],
        }
        | HALF_ROTARY,
    },
}
OTHER = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
NEW_TOKENS = 24


def family_model(config_name: str) -> transformers.PreTrainedModel:
    """The tiny model of `config_name` ("Qwen3Config", "Phi3Config:partial"...) to write."""
    return make_tiny_family_model(
        config_name.partition(":")[0],
        seed=4,
        vocab_size=300,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **FAMILY_FIELDS.get(config_name, {}),
    )


@pytest.mark.parametrize(
    "config_name",
    [
        "LlamaConfig",
        "Qwen2Config",
        "Qwen3Config",
        "Gemma2Config",
        "Gemma3TextConfig",
        "Phi3Config",
        "Phi3Config:partial",
        "Phi3Config:longrope",
    ],
)
def test_a_gguf_of_the_family_serves_packed_on_the_lean_pass(config_name, tmp_path) -> None:
    """Qwen2 and Qwen3 keep their q/k rows as written (llama.cpp permutes a Llama's alone);
    Qwen2's biased q/k/v stay unpacked; Qwen3's and Gemma 3's q/k norms come from the file,
    Gemma's norms stored as llama.cpp stores them (1 + weight), Gemma 2's caps from its header;
    Phi-3's fused q/k/v and gate/up are packed as they are, four linears a layer."""
    plain = family_model(config_name)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(plain, path, loadable=True)  # plain now holds the file's weights
    model = load_model(path, cache_dir=tmp_path).model
    assert model.config.model_type == plain.config.model_type
    runner = ModelRunner(model)
    assert runner.lean
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    per_layer = 4 if config_name.startswith(("Qwen2", "Phi3")) else 7
    assert len(packed) == per_layer * 2 + 1
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    assert_nodes_match(plain, PROMPT, tree, runner.forward(cache, [RowInput(tree)])[0], 1e-4)
    assert_speculation_equals_plain_decoding(model)


@pytest.mark.parametrize("config_name", ["Phi3Config", "Phi3Config:partial", "Phi3Config:longrope"])
@pytest.mark.parametrize("quantization", ["auto", pytest.param("gguf-int8", marks=needs_int8)])
def test_a_phi3_gguf_serves_packed_as_its_model_decodes(
    config_name, quantization, tmp_path
) -> None:
    """A Phi-3 GGUF as llama.cpp writes one (q/k/v and gate/up as fused tensors, the rotary
    embedding's dimensions in `phi3.rope.dimension_count`, LongRoPE's factors as tensors, none
    of which transformers' GGUF loading reads) through the loader: every linear packed into
    Phi-3's own modules, the rotary embedding the file's. With float activations (what `auto`
    serves) greedy output equals that of the model the file was written from, with speculation
    off, fixed and auto, batched and alone; the 8-bit path's speculation equals its plain
    decoding."""
    plain = family_model(config_name)
    write_tiny_gguf(plain, tmp_path / "phi3.gguf", loadable=True)
    loaded = load_model(tmp_path / "phi3.gguf", cache_dir=tmp_path, quantization=quantization)
    served = loaded.model
    assert loaded.quantization == ("gguf" if quantization == "auto" else quantization)
    for layer in served.model.layers:
        assert all(isinstance(layer.get_submodule(n), PackedLinear) for n in PHI3_LINEARS.values())
    assert served.config.rope_parameters == plain.config.rope_parameters
    if quantization == "gguf-int8":
        assert_speculation_equals_plain_decoding(served)
        return
    want = {tuple(p): reference_greedy(plain, p, NEW_TOKENS) for p in (PROMPT, OTHER)}
    engine = make_engine(
        ModelRunner(served), TableSlot(compute_tables(served, batch_size=16, show_progress=False))
    )
    assert_decodes_as(engine, want, NEW_TOKENS)
