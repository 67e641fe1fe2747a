"""Logprobs of committed tokens: the model's raw log-softmax, whatever the speculation shape."""

from __future__ import annotations

import pytest
import torch

from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams

REPETITIVE = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # context lookup has matches, so drafts get accepted
NEW_TOKENS = 30
TOP = 5


def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) from one plain forward over the whole sequence."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [len, vocab]
    positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
    return [float(logprobs[p, token]) for p, token in zip(positions, output)]


def run(
    engine: Engine, spec: SpeculationParams, sampling: SamplingParams = SamplingParams(), **kwargs
):
    params = GenerationParams(
        NEW_TOKENS, speculation=spec, strategy="context", sampling=sampling, logprobs=TOP, **kwargs
    )
    return engine.complete(REPETITIVE, params)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.8, top_k=10, seed=3)],
    ids=["greedy", "sampled"],
)
def test_logprobs_agree_with_and_without_speculation_and_with_a_plain_forward(
    tiny_model,
    tiny_engine: Engine,
    sampling: SamplingParams,
) -> None:
    plain = run(tiny_engine, SpeculationParams(0, 0, "off"), sampling)
    speculative = run(tiny_engine, SpeculationParams(4, 4), sampling)
    assert (
        speculative.num_accepted_tokens > 0
    )  # drafts were accepted: their nodes' logits were used
    assert speculative.token_ids == plain.token_ids
    assert [lp.token_id for lp in speculative.logprobs] == speculative.token_ids
    expected = reference_logprobs(tiny_model, REPETITIVE, plain.token_ids)
    for completion in (plain, speculative):
        got = [lp.logprob for lp in completion.logprobs]
        assert got == pytest.approx(expected, abs=1e-4)
    for a, b in zip(plain.logprobs, speculative.logprobs):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_top_logprobs_are_sorted_of_the_asked_length_and_lead_with_the_greedy_token(
    tiny_engine: Engine,
) -> None:
    completion = run(tiny_engine, SpeculationParams(4, 4))
    assert len(completion.logprobs) == NEW_TOKENS
    for lp in completion.logprobs:
        values = [v for _, v in lp.top]
        assert len(lp.top) == TOP and len({t for t, _ in lp.top}) == TOP
        assert values == sorted(values, reverse=True)
        assert lp.top[0] == (
            lp.token_id,
            pytest.approx(lp.logprob),
        )  # greedy: the chosen is the likeliest


def test_sampled_tokens_get_their_own_logprob_not_the_top_ones(tiny_engine: Engine) -> None:
    """At temperature 1.5 some sampled token is not the argmax; its logprob is still its own."""
    completion = run(tiny_engine, SpeculationParams(4, 4), SamplingParams(temperature=1.5, seed=11))
    assert any(lp.top[0][0] != lp.token_id for lp in completion.logprobs)
    for lp in completion.logprobs:
        assert lp.logprob <= lp.top[0][1] + 1e-6
        assert all(v == pytest.approx(lp.logprob) for t, v in lp.top if t == lp.token_id)


def test_logprobs_are_cut_with_the_tokens_at_a_stop(tiny_engine: Engine) -> None:
    free = run(tiny_engine, SpeculationParams(4, 4))
    stop = free.token_ids[7]
    cut = run(tiny_engine, SpeculationParams(4, 4), stop_token_ids=frozenset({stop}))
    assert cut.finish_reason == "stop" and len(cut.token_ids) == free.token_ids.index(stop) + 1
    assert [lp.token_id for lp in cut.logprobs] == cut.token_ids
    expected = [lp.logprob for lp in free.logprobs[: len(cut.token_ids)]]
    assert [lp.logprob for lp in cut.logprobs] == pytest.approx(expected, abs=1e-4)


def test_no_logprobs_unless_asked(tiny_engine: Engine) -> None:
    params = GenerationParams(8, speculation=SpeculationParams(4, 4), strategy="context")
    rounds = list(tiny_engine.generate(REPETITIVE, params))
    assert all(r.logprobs is None for r in rounds)
    zero = tiny_engine.complete(REPETITIVE, GenerationParams(8, logprobs=0))
    assert len(zero.logprobs) == 8 and all(lp.top == [] for lp in zero.logprobs)
