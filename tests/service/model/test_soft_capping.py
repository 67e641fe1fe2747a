"""Gemma 2's soft-capped attention scores and logits (cap * tanh(x / cap)), served on the lean
pass: a tiny Gemma 2 whose caps bite, past its window. Its pass equals transformers' bit for
bit; tree logits equal transformers' own sequential decoding on the float path, the packed one
and the 8-bit one; greedy output equals transformers' `generate` with speculation off, fixed and
auto, batched and alone; a Gemma 2 GGUF serves through the loader, its caps from the file."""

from __future__ import annotations

import pytest
import torch

from drafting import TableSlot, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.kernels.packed_linear import PackedLinear, load_kernels, pack_gguf_linears
from service.model.attention import layer_windows
from service.model.loader import load_model
from service.model.runner import ModelRunner, RowInput
from service.model.tables import compute_tables
from service.model.tree import build_tree
from tests.helpers.engines import assert_decodes_as, make_engine
from tests.helpers.kernels import needs_int8
from tests.helpers.models import GEMMA2_CAPS, make_tiny_gemma2
from tests.helpers.packed import assert_speculation_equals_plain_decoding, write_tiny_gguf
from tests.helpers.passes import DRAFTS, assert_nodes_match, prefilled

load_kernels()
WINDOW = 4
PROMPT = [5, 9, 13, 2, 7, 7, 30, 41, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 22, 17]
OTHER = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
NEW_TOKENS = 16


def twins(**config: object):
    """The model to serve and its untouched twin (the same weights) that transformers' own
    eager attention runs, caps and windows applied by its code."""
    return make_tiny_gemma2(window=WINDOW, **config), make_tiny_gemma2(window=WINDOW, **config)


def generated(model, prompt: list[int]) -> list[int]:
    """transformers' greedy `generate` (its own cache and masks), with no EOS stop."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine_for(model) -> Engine:
    tables = TableSlot(compute_tables(model, batch_size=16, show_progress=False))
    return make_engine(ModelRunner(model), tables)


def test_the_tiny_models_caps_bite() -> None:
    """Without a cap its tree logits differ: a pass that skipped one would fail the tests."""
    served, _ = twins()
    assert None in layer_windows(served.config) and WINDOW in layer_windows(served.config)
    tree = build_tree(PROMPT[-1], DRAFTS)
    capped = ModelRunner(served).forward(prefilled(ModelRunner(served), [PROMPT]), [RowInput(tree)])
    for field in GEMMA2_CAPS:
        uncapped, _ = twins(**{field: None})
        runner = ModelRunner(uncapped)
        logits = runner.forward(prefilled(runner, [PROMPT]), [RowInput(tree)])
        assert (logits[0] - capped[0]).abs().max() > 0.1, field


def test_the_lean_pass_gives_transformers_pass_bit_for_bit() -> None:
    served, _ = twins()
    lean, reference = ModelRunner(served), ModelRunner(served)
    assert lean.lean and lean.logit_cap == 3.0 and lean.attention_cap == 5.0
    reference.lean = False
    tree = build_tree(PROMPT[-1], DRAFTS)
    lean_logits, reference_logits = (
        runner.forward(prefilled(runner, [PROMPT]), [RowInput(tree)])[0]
        for runner in (lean, reference)
    )
    assert torch.equal(lean_logits, reference_logits)


def test_tree_nodes_past_the_window_equal_sequential_decoding() -> None:
    served, reference = twins()
    runner = ModelRunner(served)
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    assert_nodes_match(reference, PROMPT, tree, runner.forward(cache, [RowInput(tree)])[0])


def test_greedy_output_equals_transformers_generate() -> None:
    served, reference = twins()
    want = {tuple(p): generated(reference, p) for p in (PROMPT, OTHER)}
    engine = engine_for(served)
    assert_decodes_as(engine, want, NEW_TOKENS)


@pytest.mark.parametrize(
    "int8", [False, pytest.param(True, marks=needs_int8)], ids=["gguf", "gguf-int8"]
)
@pytest.mark.parametrize("dense", [False, True], ids=["windowed", "dense"])
def test_packed_layers_cap_in_the_kernels(dense, int8, tmp_path) -> None:
    """The packed path's attention kernel caps decode rows and tree nodes (every row on the
    8-bit path); the chunk kernel caps the prompt's tokens too, windowed or not."""
    layers = {"layer_types": ["full_attention"] * 2} if dense else {}
    served, reference = twins(**layers)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(reference, path)  # the reference now holds the file's weights
    served.load_state_dict(reference.state_dict())
    pack_gguf_linears(served, path, int8_activations=int8)
    runner = ModelRunner(served)
    assert runner.chunk_kernel
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    logits = runner.forward(cache, [RowInput(tree)])[0]
    # the 8-bit path rounds its activations, and this model's q/k weights scale that rounding
    # up into its scores: 0.21 off here, 0.49 with its attention uncapped
    assert_nodes_match(reference, PROMPT, tree, logits, 0.3 if int8 else 1e-4)
    assert_speculation_equals_plain_decoding(served)


def test_a_gemma_2_gguf_serves_packed_with_the_files_caps(tmp_path) -> None:
    """A Gemma 2 GGUF as llama.cpp writes one (norms as 1 + weight, its caps and window in the
    header) through the loader: packed on the lean pass, its caps taken from the file (the
    config class's defaults are 50 and 30), greedy output past the window equal to
    transformers' `generate` of the model written, with speculation off, fixed and auto."""
    model = make_tiny_gemma2(window=WINDOW, bos_token_id=1, eos_token_id=2)
    write_tiny_gguf(model, tmp_path / "gemma2.gguf", loadable=True)  # model: the file's weights
    served = load_model(tmp_path / "gemma2.gguf", cache_dir=tmp_path).model
    assert served.config.model_type == "gemma2"
    assert served.config.attn_logit_softcapping == GEMMA2_CAPS["attn_logit_softcapping"]
    assert served.config.final_logit_softcapping == GEMMA2_CAPS["final_logit_softcapping"]
    assert any(isinstance(m, PackedLinear) for m in served.modules())
    want = {tuple(p): generated(model, p) for p in (PROMPT, OTHER)}
    engine = engine_for(served)
    assert engine.runner.lean
    assert_decodes_as(
        engine,
        want,
        NEW_TOKENS,
        (SpeculationParams(), SpeculationParams(4, 3), SpeculationParams(6, 5, mode="auto")),
    )


def test_fixed_shape_passes_and_the_device_round_cap_too() -> None:
    """A Gemma 2 with no windowed layer takes the fixed-shape passes (run eagerly here; CUDA
    graphs of the same pass on a GPU): its tree logits equal sequential decoding; the device
    round's logits leave the model through the runner too, capped: its greedy output equals
    transformers' `generate`."""
    dense = {"layer_types": ["full_attention"] * 2}
    served, reference = twins(**dense)
    runner = ModelRunner(served, static_passes=True)
    assert runner.static is not None
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    assert_nodes_match(reference, PROMPT, tree, runner.forward(cache, [RowInput(tree)])[0])
    assert runner.static.shapes  # the tree's pass ran at a fixed shape
    engine = Engine(
        ModelRunner(served), default_mixer(), eos_token_ids=[], max_context=512, device_round=True
    )
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(4, 3))
    completions = engine.complete_many([(PROMPT, params), (OTHER, params)])
    assert [c.token_ids for c in completions] == [generated(reference, p) for p in (PROMPT, OTHER)]
    assert engine.device_round is not None and engine.device_round.copies > 0
