"""Model families through the whole loader: a GGUF of each architecture the lean pass takes,
written in the test as llama.cpp writes one, served packed on the lean pass, where its tree
logits equal transformers' own sequential decoding of the same weights, and speculation equals
plain decoding."""

from __future__ import annotations

import pytest

from service.kernels.packed_linear import PackedLinear, load_kernels
from service.model.loader import load_model
from service.model.runner import ModelRunner, RowInput
from service.model.tree import build_tree
from tests.helpers.models import make_tiny_family_model
from tests.helpers.packed import assert_speculation_equals_plain_decoding, write_tiny_gguf
from tests.helpers.passes import DRAFTS, PROMPT, assert_nodes_match, prefilled

load_kernels()  # from the source tree's cache, not each test's own cache directory


@pytest.mark.parametrize(
    "config_name",
    ["LlamaConfig", "Qwen2Config", "Qwen3Config", "Gemma2Config", "Gemma3TextConfig"],
)
def test_a_gguf_of_the_family_serves_packed_on_the_lean_pass(config_name, tmp_path) -> None:
    """Qwen2 and Qwen3 keep their q/k rows as written (llama.cpp permutes a Llama's alone);
    Qwen2's biased q/k/v stay unpacked; Qwen3's and Gemma 3's q/k norms come from the file,
    Gemma's norms stored as llama.cpp stores them (1 + weight), Gemma 2's caps from its
    header."""
    plain = make_tiny_family_model(
        config_name,
        seed=4,
        vocab_size=300,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(plain, path, loadable=True)  # plain now holds the file's weights
    model = load_model(path, cache_dir=tmp_path).model
    assert model.config.model_type == plain.config.model_type
    runner = ModelRunner(model)
    assert runner.lean
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == (4 if config_name == "Qwen2Config" else 7) * 2 + 1
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    assert_nodes_match(plain, PROMPT, tree, runner.forward(cache, [RowInput(tree)])[0], 1e-4)
    assert_speculation_equals_plain_decoding(model)
