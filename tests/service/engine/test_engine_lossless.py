"""Speculative greedy output must equal plain greedy decoding, token for token."""

from __future__ import annotations

import pytest

from drafting import STANDALONE_NAMES, STRATEGY_NAMES, Mixer
from service.engine.engine import ContextTooLong, Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.model.runner import ModelRunner
from tests.helpers.costs import COMPUTE_BOUND, MEMORY_BOUND
from tests.helpers.engines import NEW_TOKENS, PROMPTS, OracleDrafter, reference_greedy


@pytest.mark.parametrize("prompt", PROMPTS, ids=["mixed", "repetitive", "one-token", "long"])
@pytest.mark.parametrize("k,w", [(0, 0), (1, 1), (1, 4), (3, 3), (8, 5)])
def test_mixed_drafts_are_lossless(tiny_model, tiny_engine: Engine, prompt, k, w) -> None:
    expected = reference_greedy(tiny_model, prompt, NEW_TOKENS)
    params = GenerationParams(max_new_tokens=NEW_TOKENS, speculation=SpeculationParams(k, w))
    completion = tiny_engine.complete(prompt, params)
    assert completion.token_ids == expected
    assert completion.finish_reason == "length"


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["mixed", "repetitive"])
def test_every_strategy_is_lossless(tiny_model, tiny_engine: Engine, prompt, strategy) -> None:
    expected = reference_greedy(tiny_model, prompt, NEW_TOKENS)
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(4, 4), strategy=strategy)
    completion = tiny_engine.complete(prompt, params)
    assert completion.token_ids == expected
    allowed = (
        set(STRATEGY_NAMES) - {"mixed", *STANDALONE_NAMES} if strategy == "mixed" else {strategy}
    )
    assert set(completion.accepted_by_strategy) <= allowed


@pytest.mark.parametrize("k,w", [(1, 6), (4, 4), (6, 8)])
def test_long_accepted_paths_are_lossless(tiny_model, tiny_runner: ModelRunner, k, w) -> None:
    prompt = PROMPTS[0]
    truth = reference_greedy(tiny_model, prompt, NEW_TOKENS + w)
    engine = Engine(tiny_runner, Mixer([OracleDrafter(prompt, truth, seed=k)]), [], max_context=512)
    spec = SpeculationParams(k, w)
    params = GenerationParams(max_new_tokens=NEW_TOKENS, speculation=spec, strategy="oracle")
    completion = engine.complete(prompt, params)
    assert completion.token_ids == truth[:NEW_TOKENS]
    # the oracle's true branch is always accepted in full: w + 1 tokens per pass
    assert completion.num_passes <= -(-NEW_TOKENS // (w + 1))


def test_context_lookup_accepts_on_repetitive_text(tiny_engine: Engine) -> None:
    spec = SpeculationParams(4, 4)
    params = GenerationParams(max_new_tokens=NEW_TOKENS, speculation=spec, strategy="context")
    completion = tiny_engine.complete(PROMPTS[1], params)
    assert completion.num_accepted_tokens > 0
    assert completion.num_passes < NEW_TOKENS


def test_stops_at_stop_token_and_counts_it(tiny_model, tiny_engine: Engine) -> None:
    expected = reference_greedy(tiny_model, PROMPTS[0], NEW_TOKENS)
    stop = expected[10]
    first = expected.index(stop)
    params = GenerationParams(
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=frozenset({stop}),
        speculation=SpeculationParams(4, 3),
    )
    completion = tiny_engine.complete(PROMPTS[0], params)
    assert completion.token_ids == expected[: first + 1]
    assert completion.finish_reason == "stop"


def test_rounds_stream_the_tokens_they_accept(tiny_engine: Engine) -> None:
    params = GenerationParams(max_new_tokens=25, speculation=SpeculationParams(4, 4))
    rounds = list(tiny_engine.generate(PROMPTS[1], params))
    assert [r.finish_reason for r in rounds[:-1]] == [None] * (len(rounds) - 1)
    assert rounds[-1].finish_reason == "length"
    assert all(1 <= len(r.token_ids) <= 5 for r in rounds)
    assert sum(len(r.token_ids) for r in rounds) == 25


def test_context_too_long_is_refused(tiny_engine: Engine) -> None:
    with pytest.raises(ContextTooLong, match="context is 512 tokens, but the prompt has 464"):
        tiny_engine.complete(list(range(2, 60)) * 8, GenerationParams(max_new_tokens=100))


@pytest.mark.parametrize(
    "profile", [MEMORY_BOUND, COMPUTE_BOUND], ids=["memory-bound", "compute-bound"]
)
@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["mixed", "repetitive"])
def test_auto_mode_is_lossless_and_stays_within_its_maxima(
    tiny_model, tiny_engine: Engine, prompt, profile
) -> None:
    tiny_engine.profile = profile
    expected = reference_greedy(tiny_model, prompt, NEW_TOKENS)
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(6, 5, mode="auto"))
    rounds = list(tiny_engine.generate(prompt, params))
    assert [t for r in rounds for t in r.token_ids] == expected
    assert all(r.k <= 6 and r.w <= 5 and r.predicted_tokens_per_second for r in rounds)


def test_auto_mode_speculates_big_where_passes_are_free_and_not_where_they_cost(
    tiny_engine: Engine,
) -> None:
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(6, 5, mode="auto"))
    tiny_engine.profile = MEMORY_BOUND
    wide = list(tiny_engine.generate(PROMPTS[1], params))
    tiny_engine.profile = COMPUTE_BOUND
    narrow = list(tiny_engine.generate(PROMPTS[1], params))
    # (a compute-bound run may still probe a wide tree now and then: compare what was drafted)
    assert sum(r.num_draft_tokens for r in wide) > sum(r.num_draft_tokens for r in narrow)


def test_auto_mode_drafts_a_request_it_keeps_plain_only_now_and_then(
    tiny_model, tiny_engine: Engine
) -> None:
    """Where drafts never pay, drafting for every round is pure overhead: a request kept plain
    is drafted only now and then, and the pass's distributions go to the drafting layer only
    before those rounds, yet every round still gets a forecast."""
    tiny_engine.profile = COMPUTE_BOUND
    params = GenerationParams(48, speculation=SpeculationParams(6, 5, mode="auto"))
    request = tiny_engine.add_request(PROMPTS[0], params)
    asked, candidates = [], request.drafts.candidates
    request.drafts.candidates = lambda k, w: asked.append(k) or candidates(k, w)  # type: ignore[method-assign]
    learned, observe_distributions = [], request.drafts.observe_distributions
    request.drafts.observe_distributions = lambda d: learned.append(d) or observe_distributions(d)  # type: ignore[method-assign]
    due, drafts_this_step = [], tiny_engine.policy.drafts_this_step
    tiny_engine.policy.drafts_this_step = lambda r: drafts_this_step(r) and (due.append(r) or True)  # type: ignore[method-assign]
    rounds = []
    while tiny_engine.has_work:
        rounds += [out for _, out in tiny_engine.step()[0]]
    assert [t for r in rounds for t in r.token_ids] == reference_greedy(tiny_model, PROMPTS[0], 48)
    assert all(r.predicted_tokens_per_second for r in rounds)
    assert len(asked) <= len(due) < len(rounds) / 3  # due rounds draft unless no draft could pay
    assert len(learned) <= len(due)  # the round before each due one, at most


def test_a_fixed_mode_request_hands_every_pass_to_the_drafting_layer(tiny_engine: Engine) -> None:
    params = GenerationParams(12, speculation=SpeculationParams(2, 2, mode="fixed"))
    request = tiny_engine.add_request(PROMPTS[0], params)
    learned, observe_distributions = [], request.drafts.observe_distributions
    request.drafts.observe_distributions = lambda d: learned.append(d) or observe_distributions(d)  # type: ignore[method-assign]
    rounds = []
    while tiny_engine.has_work:
        rounds += [out for _, out in tiny_engine.step()[0]]
    assert len(learned) == len(rounds)


def test_auto_mode_without_a_profile_decodes_plainly(tiny_engine: Engine) -> None:
    params = GenerationParams(8, speculation=SpeculationParams(2, 3, mode="auto"))
    rounds = list(tiny_engine.generate(PROMPTS[1], params))
    assert all(
        (r.k, r.w, r.num_draft_tokens, r.predicted_tokens_per_second) == (0, 0, 0, None)
        for r in rounds
    )


def test_off_mode_is_plain_decoding(tiny_engine: Engine) -> None:
    params = GenerationParams(8, speculation=SpeculationParams(4, 4, mode="off"))
    completion = tiny_engine.complete(PROMPTS[1], params)
    assert completion.num_passes == 8 and completion.num_draft_tokens == 0
