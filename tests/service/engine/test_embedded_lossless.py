"""On the real embedded model, speculative greedy output equals `transformers`' own greedy
`generate`, except where the reference itself is a numerical tie.

A pass over n tokens may round differently from n one-token passes, so where the two tokens'
logits are (nearly) equal the argmax can flip. Such a parting is reported as a tie, counted,
and ends the comparison of that prompt (the sequences legitimately part there); any other
difference fails. A tie is what the bench calls one: the two tokens' logits, recomputed, within
`NEAR_TIE_ULPS` units in the last place of the logits' dtype (`service/bench/near_ties.py`). The
`embedded` fixture is float32 whatever the CPU; the bfloat16 path (what `--quantization none`
serves on CPUs with native bf16) is checked against its own plain decoding.

The table strategies draft from the model's own unigram/bigram tables, computed by
`service/model/tables.py` the first time and then read from the cache directory the server
uses (as the embedded weights are converted there once).
"""

from __future__ import annotations

import pytest
import torch

from drafting import TableSlot
from service.engine.config import EngineConfig
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.model.prompts import chat_prompt_ids
from service.model_drafts.draft_model import model_drafters
from service.runtime import build_engine, build_engine_with_tables
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.embedded import QUESTIONS, compare

NEW_TOKENS = 48
TABLE_STRATEGIES = ["unigram", "bigram", "extended_bigram", "mixed"]


def reference_generate(model, prompt: list[int], eos: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_speculation_matches_transformers_generate(embedded) -> None:
    engine = build_engine(embedded, TableSlot())
    model, tokenizer = embedded.model, embedded.tokenizer
    shapes = [SpeculationParams(1, 1), SpeculationParams(4, 4), SpeculationParams(8, 6)]
    outcomes: dict[str, int] = {}
    for question in QUESTIONS:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        want = reference_generate(model, prompt, sorted(engine.eos_token_ids))
        for shape in shapes:
            params = GenerationParams(
                max_new_tokens=NEW_TOKENS, speculation=shape, strategy="context"
            )
            got = engine.complete(prompt, params).token_ids
            outcome = compare(model, prompt, got, want)
            assert outcome in ("identical", "tie"), (
                f"{question!r} k={shape.k} w={shape.w}: {outcome}"
            )
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\nagainst transformers' generate: {outcomes}")  # ties should be rare
    assert outcomes.get("identical", 0) >= 0.9 * len(QUESTIONS) * len(shapes)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["embedded", "embedded_bf16"])
def test_a_real_difference_is_not_taken_for_a_tie(request, weights: str) -> None:
    """The tie check must fail a difference where the model was sure of its choice (the
    tolerance is a few rounding steps of the dtype, not a licence)."""
    loaded = request.getfixturevalue(weights)
    prompt = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    want = reference_generate(loaded.model, prompt, [loaded.tokenizer.eos_token_id])[:8]
    wrong = want[:3] + [(want[3] + 1) % len(loaded.tokenizer)] + want[4:]
    outcome = compare(loaded.model, prompt, wrong, want)
    assert outcome.startswith("differs at token 3")


@pytest.mark.slow
def test_a_batch_of_requests_matches_generate_request_by_request(embedded) -> None:
    """All questions at once, in one batch, each with another speculation mode: every output
    is still the reference's (ties counted as above)."""
    engine = build_engine(embedded, TableSlot())
    model, tokenizer = embedded.model, embedded.tokenizer
    modes = [
        SpeculationParams(0, 0, "off"),
        SpeculationParams(4, 4),
        SpeculationParams(8, 6),
        SpeculationParams(1, 3),
    ]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    requests = [
        (p, GenerationParams(NEW_TOKENS, speculation=m, strategy="context"))
        for p, m in zip(prompts, modes)
    ]
    outcomes: dict[str, int] = {}
    for prompt, completion in zip(prompts, engine.complete_many(requests)):
        outcome = compare(
            model,
            prompt,
            completion.token_ids,
            reference_generate(model, prompt, sorted(engine.eos_token_ids)),
        )
        assert outcome in ("identical", "tie"), outcome
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\nbatched, against transformers' generate: {outcomes}")
    assert engine.cache.nbytes == 0


@pytest.mark.slow
def test_table_strategies_match_transformers_generate(embedded) -> None:
    """The unigram/bigram drafts of real tables: output still the reference's, and the drafts
    were accepted (so the comparison cannot pass with empty tables drafting nothing)."""
    engine = build_engine_with_tables(embedded, EngineConfig(cost_profile=False))
    model, tokenizer = embedded.model, embedded.tokenizer
    outcomes: dict[str, int] = {}
    accepted = {strategy: 0 for strategy in TABLE_STRATEGIES}
    for question in QUESTIONS:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        want = reference_generate(model, prompt, sorted(engine.eos_token_ids))
        for strategy in TABLE_STRATEGIES:
            params = GenerationParams(
                NEW_TOKENS, speculation=SpeculationParams(4, 4), strategy=strategy
            )
            completion = engine.complete(prompt, params)
            outcome = compare(model, prompt, completion.token_ids, want)
            assert outcome in ("identical", "tie"), f"{question!r} {strategy}: {outcome}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            # mixed counts only its table drafts: context drafts alone must not pass for it
            by_strategy = completion.accepted_by_strategy.items()
            accepted[strategy] += sum(n for name, n in by_strategy if name != "context")
    print(f"\ntable strategies against transformers' generate: {outcomes}; accepted: {accepted}")
    assert outcomes.get("identical", 0) >= 0.9 * len(QUESTIONS) * len(TABLE_STRATEGIES)
    assert all(accepted.values()), accepted


@pytest.mark.slow
def test_self_draft_matches_transformers_generate(embedded) -> None:
    """The real model's first layers drafting for it, alone, staged and mixed: output still the
    reference's, and the self-draft had tokens accepted."""
    drafters = model_drafters(embedded, (None,), staged=True)
    engine = build_engine(embedded, TableSlot(), drafters=drafters)
    model, tokenizer = embedded.model, embedded.tokenizer
    accepted = 0
    for question in QUESTIONS[:2]:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        want = reference_generate(model, prompt, sorted(engine.eos_token_ids))
        for strategy in ["self_draft", "self_draft_staged", "context+self_draft"]:
            params = GenerationParams(
                NEW_TOKENS, speculation=SpeculationParams(4, 4), strategy=strategy
            )
            completion = engine.complete(prompt, params)
            outcome = compare(model, prompt, completion.token_ids, want)
            assert outcome in ("identical", "tie"), f"{question!r} {strategy}: {outcome}"
            accepted += sum(
                n
                for name, n in completion.accepted_by_strategy.items()
                if name.startswith("self_draft")
            )
    assert accepted > 0


@pytest.fixture(scope="module")
def embedded_bf16():
    """The embedded model in bf16: what `--quantization none` serves on a CPU with native bf16."""
    from service.model.loader import load_model

    return load_model(quantization="none", dtype="bfloat16")


@pytest.mark.slow
def test_bf16_speculation_matches_plain_decoding_of_the_same_path(embedded_bf16) -> None:
    """Losslessness is defined against the served weights: in bf16, speculative output equals
    the bf16 plain output (ties counted), alone and in a batch with other modes."""
    engine = build_engine(embedded_bf16, TableSlot())
    model, tokenizer = embedded_bf16.model, embedded_bf16.tokenizer
    assert model.dtype == torch.bfloat16
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    plain = [engine.complete(p, GenerationParams(NEW_TOKENS)).token_ids for p in prompts]
    outcomes: dict[str, int] = {}
    for shape in [SpeculationParams(4, 4), SpeculationParams(8, 6)]:
        for prompt, want in zip(prompts, plain):
            got = engine.complete(
                prompt, GenerationParams(NEW_TOKENS, speculation=shape, strategy="context")
            ).token_ids
            outcome = compare(model, prompt, got, want)
            assert outcome in ("identical", "tie"), f"k={shape.k} w={shape.w}: {outcome}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    modes = [
        SpeculationParams(0, 0, "off"),
        SpeculationParams(4, 4),
        SpeculationParams(8, 6),
        SpeculationParams(1, 3),
    ]
    batch = [
        (p, GenerationParams(NEW_TOKENS, speculation=m, strategy="context"))
        for p, m in zip(prompts, modes)
    ]
    for prompt, want, completion in zip(prompts, plain, engine.complete_many(batch)):
        outcome = compare(model, prompt, completion.token_ids, want)
        assert outcome in ("identical", "tie"), f"batched: {outcome}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\nbf16, against bf16 plain decoding: {outcomes}")
    assert outcomes.get("identical", 0) >= 0.75 * sum(outcomes.values())


@pytest.mark.slow
def test_structured_output_with_speculation_matches_plain(embedded) -> None:
    """The extraction benchmark's schema on three of its documents: speculative answers (two
    fixed shapes) equal plain constrained decoding's, and they parse and match the schema."""
    import json

    import jsonschema

    from service.bench import structured
    from service.grammar import GrammarSpec

    engine = build_engine(embedded, TableSlot())
    grammar = GrammarSpec("json_schema", json.dumps(structured.SCHEMA))
    outcomes: dict[str, int] = {}
    for prompt in structured.prompts(embedded.tokenizer, structured.documents(3)):
        want = engine.complete(
            prompt, GenerationParams(max_new_tokens=96, grammar=grammar)
        ).token_ids
        jsonschema.validate(
            json.loads(embedded.tokenizer.decode(want, skip_special_tokens=True)), structured.SCHEMA
        )
        for shape in [SpeculationParams(4, 4), SpeculationParams(8, 8)]:
            got = engine.complete(
                prompt, GenerationParams(max_new_tokens=96, speculation=shape, grammar=grammar)
            ).token_ids
            outcome = compare(embedded.model, prompt, got, want)
            assert outcome in ("identical", "tie"), f"k={shape.k} w={shape.w}: {outcome}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("identical", 0) >= 5


@pytest.mark.slow
def test_device_round_matches_generate_and_samples_as_the_host_path(embedded) -> None:
    """The device round on the embedded model (here on the CPU): a batch in fixed mode and one
    in auto mode (a flat scripted profile, so its trees grow) equal `generate` (ties counted as
    above), and seeded samples equal the host path's."""
    model, tokenizer = embedded.model, embedded.tokenizer
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = build_engine(embedded, TableSlot(), EngineConfig(device_round=True))
    engine.profile = MEMORY_BOUND
    outcomes: dict[str, int] = {}
    for spec in (SpeculationParams(8, 6), SpeculationParams(8, 6, "auto")):
        completions = engine.complete_many(
            [(p, GenerationParams(NEW_TOKENS, speculation=spec)) for p in prompts]
        )
        for prompt, completion in zip(prompts, completions):
            outcome = compare(
                model,
                prompt,
                completion.token_ids,
                reference_generate(model, prompt, sorted(engine.eos_token_ids)),
            )
            assert outcome in ("identical", "tie"), f"{spec}: {outcome}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        assert sum(c.num_accepted_tokens for c in completions) > 0
    print(f"\ndevice round against transformers' generate: {outcomes}")
    assert engine.device_round.copies > NEW_TOKENS // 2
    seeded = [
        (
            p,
            GenerationParams(
                NEW_TOKENS,
                speculation=SpeculationParams(4, 4),
                sampling=SamplingParams(0.7, seed=i),
            ),
        )
        for i, p in enumerate(prompts)
    ]
    host = build_engine(embedded, TableSlot(), EngineConfig(device_round=False))
    assert [c.token_ids for c in engine.complete_many(seeded)] == [
        c.token_ids for c in host.complete_many(seeded)
    ]
