"""The served GPU path: bf16 weights on a CUDA device, small passes replayed as CUDA graphs.
Greedy speculative output equals plain decoding (or parts at a near tie of the reference, as
on the CPU's bf16 path), alone and batched, and a seeded sample is the same sample with
speculation. Run by `make gpu-check` (`tests/gpu/check.sh`) on a machine with a GPU; where
there is none, as in CI, these tests are skipped, saying so."""

from __future__ import annotations

import os

import pytest
import torch

from drafting import TableSlot
from service.bench.near_ties import first_difference
from service.engine.config import EngineConfig
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.model.loader import LoadedModel, load_model
from service.model.prompts import chat_prompt_ids
from service.runtime import build_engine
from tests.helpers.embedded import QUESTIONS, compare

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)"
)

NEW_TOKENS = 64
SHAPES = [SpeculationParams(4, 4), SpeculationParams(8, 8)]


@pytest.fixture(scope="module")
def served() -> LoadedModel:
    """The embedded model as the server loads it on a GPU (its GGUF from `NGRAMMYS_GPU_MODEL`
    where the embedded package is not installed)."""
    return load_model(os.environ.get("NGRAMMYS_GPU_MODEL"), device="cuda")


def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def test_the_passes_run_as_cuda_graphs(served) -> None:
    engine = build_engine(served, TableSlot())
    assert engine.runner.static is not None and engine.runner.static.capture
    engine.complete(prompts(served)[0], GenerationParams(8, speculation=SpeculationParams(4, 4)))
    assert engine.runner.static.capture_seconds > 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"k{s.k}w{s.w}")
def test_greedy_speculation_equals_plain_decoding_alone_and_batched(served, shape) -> None:
    engine = build_engine(served, TableSlot())
    asked = prompts(served)
    plain = [
        engine.complete(
            p, GenerationParams(NEW_TOKENS, speculation=SpeculationParams(mode="off"))
        ).token_ids
        for p in asked
    ]
    params = GenerationParams(NEW_TOKENS, speculation=shape)
    alone = [engine.complete(p, params).token_ids for p in asked]
    batched = [c.token_ids for c in engine.complete_many([(p, params) for p in asked])]
    outcomes = [
        compare(served.model, p, got, want)
        for runs in (alone, batched)
        for p, got, want in zip(asked, runs, plain)
    ]
    print(f"\nk={shape.k} w={shape.w} against plain decoding: {outcomes}")
    assert all(outcome in ("identical", "tie") for outcome in outcomes), outcomes
    assert outcomes.count("identical") >= len(outcomes) // 2


@pytest.fixture(scope="module")
def served_float32() -> LoadedModel:
    """The embedded model in float32 on the GPU: the passes of different shapes that plain and
    speculative decoding take round a bf16 logit differently, and a uniform that falls within
    that rounding of a sampled token's edge picks its neighbour; in float32 that is too rare to
    meet in these tests."""
    return load_model(os.environ.get("NGRAMMYS_GPU_MODEL"), device="cuda", dtype="float32")


def test_a_seeded_sample_is_the_same_with_speculation(served_float32) -> None:
    served = served_float32
    engine = build_engine(served, TableSlot())
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    asked = prompts(served)
    plain = [
        engine.complete(
            p,
            GenerationParams(
                NEW_TOKENS, sampling=sampling, speculation=SpeculationParams(mode="off")
            ),
        ).token_ids
        for p in asked
    ]
    speculative = [
        engine.complete(
            p, GenerationParams(NEW_TOKENS, sampling=sampling, speculation=SpeculationParams(8, 8))
        ).token_ids
        for p in asked
    ]
    parted = [first_difference(p, s) for p, s in zip(plain, speculative)]
    print(f"\nseeded samples part from plain sampling at: {parted}")
    assert speculative == plain


def test_structured_output_on_the_gpu_is_valid_and_equals_plain(served) -> None:
    """The extraction benchmark's schema with the logits on the device: every answer parses and
    matches, and speculative answers equal plain constrained decoding's (or part at a near tie)."""
    import json

    import jsonschema

    from service.bench import structured
    from service.grammar import GrammarSpec

    engine = build_engine(served, TableSlot())
    grammar = GrammarSpec("json_schema", json.dumps(structured.SCHEMA))
    for prompt in structured.prompts(served.tokenizer, structured.documents(2)):
        want = engine.complete(prompt, GenerationParams(96, grammar=grammar)).token_ids
        jsonschema.validate(
            json.loads(served.tokenizer.decode(want, skip_special_tokens=True)), structured.SCHEMA
        )
        got = engine.complete(
            prompt, GenerationParams(96, speculation=SpeculationParams(8, 8), grammar=grammar)
        ).token_ids
        assert compare(served.model, prompt, got, want) in ("identical", "tie")


def test_device_round_steps_take_one_copy_back_and_equal_the_host_path(served) -> None:
    """On a GPU the fixed-mode steps run as device rounds: the same tokens as the host path
    (or parted at a near tie), and each such step makes the host wait once, for its one copy
    back (`torch.cuda.set_sync_debug_mode` warns at every synchronizing call)."""
    import warnings

    asked = prompts(served)
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(8, 8))
    host = build_engine(served, TableSlot(), EngineConfig(device_round=False))
    want = [c.token_ids for c in host.complete_many([(p, params) for p in asked])]
    engine = build_engine(served, TableSlot())
    assert engine.device_round is not None
    requests = [engine.add_request(p, params) for p in asked]
    outputs: dict[int, list[int]] = {id(r): [] for r in requests}

    def step() -> None:
        for request, out in engine.step()[0]:
            outputs[id(request)].extend(out.token_ids)

    while any(r.prefill_remaining for r in requests):
        step()
    step()
    syncs, device_steps = [], 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(8):
                copies = engine.device_round.copies
                step()
                device_steps += engine.device_round.copies - copies
        finally:
            torch.cuda.set_sync_debug_mode("default")
        messages = [str(w.message).splitlines()[0] for w in caught]
        syncs = [m for m in messages if "called a synchronizing CUDA operation" in m]
    print(f"\n{device_steps} device-round steps, {len(syncs)} synchronizing calls: {syncs}")
    assert device_steps == 8
    # the steps past the first replay the round's recorded operators
    assert engine.device_round.graphs.recorded >= 2
    assert len(syncs) <= device_steps, syncs
    while engine.has_work:
        step()
    got = [outputs[id(r)] for r in requests]
    outcomes = [compare(served.model, p, g, w) for p, g, w in zip(asked, got, want)]
    print(f"device round against the host path: {outcomes}")
    assert all(outcome in ("identical", "tie") for outcome in outcomes), outcomes
