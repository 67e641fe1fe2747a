"""logit_bias, the penalties and min-p keep speculation lossless: speculative output equals
plain decoding's with the same controls, greedy token for token and seeded samples seed for
seed, in fixed and auto mode; plain decoding equals an independent full-recompute reference
that adjusts token by token; and each control visibly does what it says."""

from __future__ import annotations

from collections import Counter

import pytest

from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.engines import NEW_TOKENS, PROMPTS, reference_decode, reference_greedy

SHAPES = [SpeculationParams(4, 3), SpeculationParams(8, 5), SpeculationParams(8, 6, "auto")]
CONTROLS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.4},
    "repetition<1": {"repetition_penalty": 0.7},
    "bias": {"logit_bias": {7: 3.0, 20: -5.0, 43: 1.0}},
    "all": {
        "logit_bias": {60: -2.0},
        "repetition_penalty": 1.2,
        "frequency_penalty": -0.5,
        "presence_penalty": 0.9,
    },
}


@pytest.mark.parametrize("control", CONTROLS)
@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["mixed", "repetitive"])
def test_greedy_speculation_with_adjustments_equals_plain_decoding(
    tiny_model, tiny_engine: Engine, control, prompt
) -> None:
    tiny_engine.profile = MEMORY_BOUND  # auto rows speculate
    sampling = SamplingParams(**CONTROLS[control])
    expected = reference_decode(tiny_model, prompt, NEW_TOKENS, sampling)
    assert expected != reference_greedy(tiny_model, prompt, NEW_TOKENS)  # the control matters here
    assert (
        tiny_engine.complete(prompt, GenerationParams(NEW_TOKENS, sampling=sampling)).token_ids
        == expected
    )
    accepted = 0
    for shape in SHAPES:
        spec = tiny_engine.complete(
            prompt, GenerationParams(NEW_TOKENS, speculation=shape, sampling=sampling)
        )
        assert spec.token_ids == expected, shape
        accepted += spec.num_accepted_tokens
    assert accepted > 0  # speculation really took part


@pytest.mark.parametrize("control", [*CONTROLS, "min_p"])
def test_seeded_sampling_with_adjustments_equals_plain_sampling(
    tiny_model, tiny_engine: Engine, control
) -> None:
    tiny_engine.profile = MEMORY_BOUND
    controls = {"min_p": 0.15} if control == "min_p" else CONTROLS[control]
    accepted = 0
    for seed in range(6):
        sampling = SamplingParams(temperature=0.8, seed=seed, **controls)
        plain = tiny_engine.complete(PROMPTS[1], GenerationParams(30, sampling=sampling))
        assert plain.token_ids == reference_decode(tiny_model, PROMPTS[1], 30, sampling), seed
        for shape in SHAPES:
            spec = tiny_engine.complete(
                PROMPTS[1], GenerationParams(30, speculation=shape, sampling=sampling)
            )
            assert spec.token_ids == plain.token_ids, (seed, shape)
            accepted += spec.num_accepted_tokens
    assert accepted > 0


def complete(engine: Engine, sampling: SamplingParams, prompt: list[int] = PROMPTS[1]) -> list[int]:
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(4, 3), sampling=sampling)
    return engine.complete(prompt, params).token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_large_bias_forces_its_token_and_a_negative_one_bans_tokens(
    tiny_engine: Engine, temperature
) -> None:
    assert (
        complete(tiny_engine, SamplingParams(temperature, seed=1, logit_bias={42: 100.0}))
        == [42] * NEW_TOKENS
    )
    usual = set(complete(tiny_engine, SamplingParams(temperature, seed=1)))
    banned = complete(
        tiny_engine, SamplingParams(temperature, seed=1, logit_bias={t: -100.0 for t in usual})
    )
    assert not usual & set(banned)


def test_a_large_presence_penalty_avoids_repeats(tiny_engine: Engine) -> None:
    assert (
        max(Counter(complete(tiny_engine, SamplingParams())).values()) > 1
    )  # the model alone repeats
    output = complete(tiny_engine, SamplingParams(presence_penalty=2.0))
    assert len(set(output)) == len(output) == NEW_TOKENS


def test_a_frequency_penalty_spreads_the_output(tiny_engine: Engine) -> None:
    def most_repeated(sampling: SamplingParams) -> int:
        return max(Counter(complete(tiny_engine, sampling)).values())

    assert most_repeated(SamplingParams(frequency_penalty=1.0)) < most_repeated(SamplingParams())


def test_min_p_of_one_samples_the_argmax(tiny_engine: Engine) -> None:
    greedy = complete(tiny_engine, SamplingParams())
    assert all(
        complete(tiny_engine, SamplingParams(1.5, seed=seed, min_p=1.0)) == greedy
        for seed in range(3)
    )
    assert complete(tiny_engine, SamplingParams(1.5, seed=0)) != greedy
