"""Where greedy answers part, and the bench telling a near tie of two logits from a defect."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from drafting import default_mixer
from service.bench.near_ties import (
    MIN_TIE_ULPS,
    first_difference,
    next_token_logits,
    parting,
    reference_of,
    ulp,
)
from service.bench.specbench import BenchPrompt, parted_beyond_near_ties, run_bench
from service.engine.engine import Engine
from service.engine.outputs import Completion
from service.engine.params import GenerationParams, SamplingParams
from service.model.runner import ModelRunner
from tests.helpers.models import TINY_VOCAB, make_tiny_model


def test_the_first_difference_of_two_answers() -> None:
    assert first_difference([4, 5, 6], [4, 5, 6]) is None
    assert first_difference([4, 5, 6], [4, 7, 6]) == 1
    assert first_difference([4, 5], [4, 5, 6]) == 2  # one is the other cut short


@pytest.mark.parametrize("magnitude", [0.3, 1.0, 26.6, 1000.0])
def test_an_ulp_is_the_spacing_of_the_dtype_at_that_magnitude(magnitude: float) -> None:
    for dtype, numpy_dtype in ((torch.float32, np.float32), (torch.float16, np.float16)):
        value = float(torch.tensor(magnitude, dtype=dtype))  # a value the dtype holds
        assert ulp(value, dtype) == float(np.spacing(numpy_dtype(value)))
    value = float(torch.tensor(magnitude, dtype=torch.bfloat16))
    step = ulp(value, torch.bfloat16)  # bf16 keeps 8 significant bits
    assert float(torch.tensor(value + step, dtype=torch.bfloat16)) == value + step
    assert (
        float(torch.tensor(value + 0.75 * step, dtype=torch.bfloat16)) == value + step
    )  # nothing between


def test_the_reference_is_the_same_weights_at_a_higher_precision_made_once() -> None:
    model = make_tiny_model(seed=2).to(torch.bfloat16)
    reference = reference_of(model)
    assert reference.dtype == torch.float32 and reference_of(model) is reference
    torch.testing.assert_close(
        reference.lm_head.weight, model.lm_head.weight.float(), atol=0, rtol=0
    )
    assert reference_of(make_tiny_model(seed=2)).dtype == torch.float64


def twin_tokens(model, prompt: list[int]) -> tuple[int, int, int]:
    """The greedy token after `prompt`, a token made its exact twin (the same LM head row), and
    one the model ranks last there."""
    logits = next_token_logits(model, prompt)
    chosen, last = int(logits.argmax()), int(logits.argmin())
    twin = next(t for t in range(TINY_VOCAB) if t not in (chosen, last))
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[chosen]
    return chosen, twin, last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_parting_is_a_tie_only_where_the_truth_has_the_two_tokens_within_the_dtypes_rounding(
    dtype,
) -> None:
    """Judged on logits computed at a higher precision: two tokens with the same LM head row are
    tied in truth whatever the served dtype rounded; a token the model ranks last is not, and
    the rounding bound is the served dtype's (wider in bf16, never under `MIN_TIE_ULPS` ulps)."""
    model = make_tiny_model(seed=4).to(dtype)
    prompt = [5, 9, 13, 2, 7]
    chosen, twin, last = twin_tokens(model, prompt)
    tie = parting(model, prompt, [chosen, 3], [twin, 3])
    assert tie is not None and tie.index == 0 and tie.gap == 0.0 and tie.near_tie
    wrong = parting(model, prompt, [chosen], [last])
    assert wrong is not None and not wrong.near_tie and wrong.gap > wrong.bound
    magnitude = float(
        next_token_logits(reference_of(model), prompt).double()[[chosen, last]].abs().max()
    )
    assert wrong.bound >= MIN_TIE_ULPS * ulp(magnitude, dtype)
    if dtype == torch.float32:  # float32 against float64: rounding of a millionth of a logit
        assert wrong.bound < 1e-5
    else:
        assert wrong.bound >= ulp(magnitude, torch.bfloat16)


class WithoutLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward takes the input ids alone (no `logits_to_keep`)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def forward(self, input_ids: torch.Tensor):
        return self.inner(input_ids)


def test_the_next_token_logits_whether_or_not_the_model_can_keep_the_last_only() -> None:
    model = make_tiny_model(seed=2)
    ids = [5, 9, 13, 2, 7]
    logits = next_token_logits(model, ids)
    assert logits.shape == (TINY_VOCAB,)
    torch.testing.assert_close(next_token_logits(WithoutLogitsToKeep(model), ids), logits)
    with torch.no_grad():
        torch.testing.assert_close(
            model(torch.tensor([ids], device=model.device)).logits[0, -1], logits
        )


class FirstTokenSwapped:
    """A decoder answering as plain decoding does but with another first token."""

    def __init__(self, engine: Engine, token: int) -> None:
        self.engine, self.token = engine, token

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> Completion:
        answer = self.engine.complete(prompt_ids, params)
        return dataclasses.replace(answer, token_ids=[self.token, *answer.token_ids[1:]])


def tied_engine_and_tokens() -> tuple[Engine, int, int, list[BenchPrompt]]:
    """An engine whose model gives two tokens the same logits everywhere (the LM head's rows of
    both equal), and the pair: plain decoding's first token and its exact tie."""
    model = make_tiny_model(seed=3)
    engine = Engine(ModelRunner(model), default_mixer(None), eos_token_ids=[], max_context=512)
    prompts = [BenchPrompt("1", "math", [5, 9, 13, 2] * 3)]
    first = engine.complete(prompts[0].prompt_ids, GenerationParams(max_new_tokens=1)).token_ids[0]
    twin = TINY_VOCAB - 1 if first != TINY_VOCAB - 1 else 0
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[first]
    chosen = engine.complete(prompts[0].prompt_ids, GenerationParams(max_new_tokens=1)).token_ids[0]
    assert chosen == min(first, twin)  # equal maxima: plain decoding takes the first
    return engine, chosen, max(first, twin), prompts


def test_the_bench_tells_an_answer_parted_at_a_tie_from_one_parted_otherwise() -> None:
    """Greedy answers that differ are looked at where they part: the tie's other token there is a
    near tie (rounding in bf16 parts answers so), any other token a difference to fail on."""
    engine, chosen, tie, prompts = tied_engine_and_tokens()
    other = next(t for t in range(TINY_VOCAB) if t not in (chosen, tie))
    seen = {}
    results = run_bench(
        engine,
        prompts,
        {},
        8,
        progress=lambda _prompt, _plain, _done, partings: seen.update(partings),
        references={
            "tie": FirstTokenSwapped(engine, tie),
            "defect": FirstTokenSwapped(engine, other),
        },
    )
    tied, defect = results["tie"][-1], results["defect"][-1]
    assert (tied.identical, tied.near_ties) == (0, 1)
    assert (defect.identical, defect.near_ties) == (0, 0)
    assert parted_beyond_near_ties(results) == ["defect"]
    assert seen["tie"].index == seen["defect"].index == 0
    assert seen["tie"].ulps == 0.0 and seen["defect"].ulps > 1e3


def test_sampled_answers_that_differ_are_not_called_near_ties() -> None:
    """With sampling a changed token may lie anywhere in the distribution: no gap of two logits
    says rounding chose it, so every difference counts."""
    engine, _, tie, prompts = tied_engine_and_tokens()
    results = run_bench(
        engine,
        prompts,
        {},
        8,
        sampling=SamplingParams(temperature=0.8, seed=1),
        references={"tie": FirstTokenSwapped(engine, tie)},
    )
    assert results["tie"][-1].near_ties == 0
    assert parted_beyond_near_ties(results) == ["tie"]
