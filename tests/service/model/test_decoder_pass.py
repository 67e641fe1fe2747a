"""The lean decoder pass (`service/model/decoder_pass.py`): each node's logits equal transformers'
own sequential decoding, for every model family it takes and for one it leaves to
transformers; fused projections compute what the separate layers did, from the same memory."""

from __future__ import annotations

import pytest
import torch
import transformers

from service.model.decoder_pass import fuse_projections
from service.model.runner import ModelRunner, RowInput
from service.model.tree import TokenTree, build_tree
from tests.helpers.models import make_tiny_family_model, make_tiny_model
from tests.helpers.passes import DRAFTS, PROMPT, assert_nodes_match, prefilled


def tiny_model(config_name: str) -> transformers.PreTrainedModel:
    """A 2-layer random model of a family (Qwen2: q/k/v biases; Qwen3: extra q/k norms;
    "Phi3Config:partial": a Phi-3 whose rotary embedding turns half of each head)."""
    if config_name == "Phi3Config:partial":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        model = make_tiny_family_model("Phi3Config", pad_token_id=0, rope_parameters=rope)
        assert model.model.rotary_emb.inv_freq.numel() * 2 == 8  # of a 16-wide head
        return model
    return make_tiny_family_model(config_name, pad_token_id=0)


@pytest.mark.parametrize(
    "config_name, lean",
    [
        ("LlamaConfig", True),
        ("Qwen2Config", True),  # biases on q, k, v: the fused projection carries them
        ("Qwen3Config", True),  # norms on each q and k head
        ("Gemma2Config", True),  # Gemma's norms, soft-capped scores and logits
        ("Gemma3TextConfig", True),  # norms of 1 + weight on both sides, q/k norms, two ropes
        ("Phi3Config", True),  # q/k/v and gate/up fused in the model
        ("Phi3Config:partial", True),  # Phi-4-mini's: rotary on a part of each head
        ("Olmo2Config", False),  # norms after attention and MLP: transformers' own layers
    ],
)
def test_tree_logits_equal_sequential_decoding_on_either_path(config_name: str, lean: bool) -> None:
    model = tiny_model(config_name)
    runner = ModelRunner(model)
    assert runner.lean is lean
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    assert_nodes_match(model, PROMPT, tree, runner.forward(cache, [RowInput(tree)])[0])


def lean_and_reference_tree_logits(
    model: torch.nn.Module, tree: TokenTree
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree's logits after PROMPT from the lean pass and from transformers' own forward."""
    lean, reference = ModelRunner(model), ModelRunner(model)
    reference.lean = False
    lean_logits, reference_logits = (
        runner.forward(prefilled(runner, [PROMPT]), [RowInput(tree)])[0]
        for runner in (lean, reference)
    )
    return lean_logits, reference_logits


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
    ],
)
def test_the_lean_pass_gives_transformers_pass_bit_for_bit(config_name: str) -> None:
    """Same operators in the same order, fewer calls: float32 logits equal exactly."""
    tree = build_tree(PROMPT[-1], DRAFTS)
    lean, reference = lean_and_reference_tree_logits(tiny_model(config_name), tree)
    assert torch.equal(lean, reference)


def test_fused_projections_share_the_layers_memory() -> None:
    model = make_tiny_model(seed=5)
    attn = model.model.layers[0].self_attn
    modules = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        alone = torch.cat([m(x) for m in modules], dim=-1)
        (qkv,) = fuse_projections(modules)
        assert torch.equal(qkv(x), alone)
        assert torch.equal(
            torch.cat([m(x) for m in modules], dim=-1), alone
        )  # each still works alone
    storages = {m.weight.untyped_storage().data_ptr() for m in modules}
    assert len(storages) == 1  # views of one fused weight: no second copy


ROPE_SCALINGS = {
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0},
}


@pytest.mark.parametrize("rope_type", ROPE_SCALINGS)
def test_scaled_rotary_embeddings_are_the_models_own(rope_type: str) -> None:
    """Llama 3's, linear, dynamic NTK and YaRN scaling: the lean pass takes its rotary tables
    from the model's own rotary module, so its tree logits equal sequential decoding, and its
    pass equals transformers' bit for bit. Past the original length (8 positions here) the
    static scalings differ from plain rotary embeddings; dynamic NTK rescales only past
    max_position_embeddings, which is the served context's bound (so no row's tables depend on
    how long the other rows of its pass are)."""
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "original_max_position_embeddings": 8}
    model = make_tiny_family_model(
        "LlamaConfig", pad_token_id=0, rope_parameters=rope | ROPE_SCALINGS[rope_type]
    )
    plain = make_tiny_family_model("LlamaConfig", pad_token_id=0)
    assert model.model.rotary_emb.rope_type == rope_type
    tree = build_tree(PROMPT[-1], DRAFTS)
    lean, reference = lean_and_reference_tree_logits(model, tree)
    assert torch.equal(lean, reference)
    assert_nodes_match(model, PROMPT, tree, lean)
    unscaled = ModelRunner(plain).forward(prefilled(ModelRunner(plain), [PROMPT]), [RowInput(tree)])
    assert torch.allclose(unscaled[0], lean) == (rope_type == "dynamic")
