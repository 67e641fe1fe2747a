"""Target distribution (temperature, min-p, top-k, top-p) and inverse-CDF sampling per position."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from service.engine.params import SamplingParams
from service.engine.sampling import (
    PositionUniforms,
    choose_tokens,
    greedy_choices,
    greedy_choices_of_rows,
    target_probs,
    top_token_ids,
    top_token_ids_of_rows,
)
from service.kernels.packed_linear import kernels_error, load_kernels, loaded_kernels
from tests.helpers.kernels import NUMBA_INSTALLED

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])  # [1, 5]


def test_temperature_scales_the_logits() -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, (LOGITS * 2).softmax(-1))


def test_top_k_keeps_the_k_most_likely() -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs[0, :2], LOGITS[0, :2].softmax(-1))
    assert probs[0, 2:].sum() == 0


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    full = LOGITS.softmax(-1)[0]  # ≈ [0.53, 0.20, 0.12, 0.07, 0.03]
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    kept = full[:2] / full[:2].sum()  # 0.53 < 0.7 ≤ 0.53 + 0.20
    torch.testing.assert_close(probs[0, :2], kept)
    assert probs[0, 2:].sum() == 0
    only_top = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert only_top[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # a top_p below float32's smallest number (JSON allows 5e-324) still keeps the top one
    tiniest = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=5e-324))
    assert tiniest[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p() -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    three = LOGITS[0, :3].softmax(-1)  # ≈ [0.63, 0.23, 0.14]: 0.63 < 0.8 ≤ 0.86
    torch.testing.assert_close(probs[0, :2], three[:2] / three[:2].sum())


def test_min_p_keeps_tokens_within_a_share_of_the_likeliest() -> None:
    full = LOGITS.softmax(-1)[0]  # ≈ [0.56, 0.21, 0.13, 0.08, 0.03]
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))  # p >= 0.17 stays
    torch.testing.assert_close(probs[0, :2], full[:2] / full[:2].sum())
    assert probs[0, 2:].sum() == 0
    assert target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=1.0))[0].tolist() == [
        1.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ]


def test_min_p_cuts_after_temperature_and_before_top_p() -> None:
    # at temperature 4, p ≈ [0.28, 0.22, 0.19, 0.17, 0.13]: all >= 0.4 × 0.28;
    # at 1, only the top one
    assert (target_probs(LOGITS, SamplingParams(temperature=4.0, min_p=0.4)) > 0).all()
    assert (target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.4)) > 0).sum() == 1
    # min-p 0.2 keeps 3 tokens, renormalized ≈ [0.63, 0.23, 0.14], of which top-p 0.85 keeps 2;
    # top-p first would keep 3 (0.56 + 0.21 < 0.85), and min-p after it all 3
    assert (
        target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.2, top_p=0.85)) > 0
    ).sum() == 2


def test_greedy_is_argmax_without_randomness() -> None:
    assert choose_tokens(LOGITS, SamplingParams(temperature=0.0), None) == [0]
    assert choose_tokens(LOGITS, SamplingParams(temperature=1.0, top_k=1), None) == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_choices_break_ties_and_nans_as_torch_does(dtype) -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, [7, 300, 999]] = 50.0  # equal maxima: the first wins
    logits[2, [5, 600]] = float("nan")  # a NaN counts as the maximum
    logits[3] = 0.0
    logits = logits.to(dtype)
    assert greedy_choices(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_choices(logits)[1:4] == [7, 5, 0]


@pytest.mark.parametrize(
    "vocab", [49152, 50257, 1000, 70, 5]
)  # whole 64-logit blocks, a tail, fewer than k blocks
def test_top_token_ids_are_torch_topk_s(vocab: int) -> None:
    """The CPU fast path's kernel (once loaded) and torch's fallback rank alike: distinct
    logits, a row whose best logits crowd one block, one holding -inf; NaN ranks last in the
    kernel (first in torch), and even an all-NaN row gets k distinct valid ids."""
    if not NUMBA_INSTALLED:
        pytest.skip("numba is not installed")
    assert load_kernels() is not None and loaded_kernels() is not None, kernels_error()
    k = min(8, vocab)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, :k] += 100.0  # all k in the first block
    logits[2, -1] = float("-inf")
    logits[3, 0] = float("nan")
    logits[4] = float("nan")
    finite = [0, 1, 2, 5]
    expected = torch.topk(logits[finite], k, dim=-1).indices.numpy()
    ids = top_token_ids(logits, k)
    assert ids.shape == (6, k) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids[finite], expected)
    without_nan = logits[3].nan_to_num(nan=float("-inf"))
    np.testing.assert_array_equal(ids[3], torch.topk(without_nan, k).indices.numpy())
    assert (
        sorted(ids[4].tolist()) == sorted(set(ids[4].tolist()))
        and 0 <= ids[4].min()
        and ids[4].max() < vocab
    )
    # torch's path
    np.testing.assert_array_equal(top_token_ids(logits[[0, 5]].double(), k), expected[[0, 3]])
    # three rows: one thread, six: split
    np.testing.assert_array_equal(top_token_ids(logits[2:5], k), ids[2:5])


def test_top_token_ids_rank_infinities_first_and_ties_by_index() -> None:
    """The kernel ranks by integer keys of the floats' bits: +inf above every number, equal
    logits (in different blocks) lowest index first, and a row of -inf still in index order."""
    if not NUMBA_INSTALLED:
        pytest.skip("numba is not installed")
    assert load_kernels() is not None, kernels_error()
    logits = torch.full((3, 1000), -1.0)
    logits[0, [900, 5, 300]] = 2.0
    logits[0, 700] = float("inf")
    logits[1] = float("-inf")
    logits[1, 999] = -1e30
    logits[2, 640:] = -0.5  # ties beyond the first block: the earliest of them
    assert top_token_ids(logits, 4).tolist() == [
        [700, 5, 300, 900],
        [999, 0, 1, 2],
        [640, 641, 642, 643],
    ]


def test_rows_taken_together_get_what_each_row_gets_alone() -> None:
    """A pass's rows (views of one logits tensor, of 1 to 7 nodes) in one call, as off the CPU,
    or a call each: the same argmax and top tokens per row."""
    generator = torch.Generator().manual_seed(4)
    sizes = [1, 3, 7, 1, 2]
    flat = torch.randn(sum(sizes), 300, generator=generator)
    flat[4, 10] = flat[4, 20] = flat[4].max() + 1  # a tie: the first maximum, both ways
    rows = list(flat.split(sizes))
    apart, together = (
        greedy_choices_of_rows(rows, together=False),
        greedy_choices_of_rows(rows, together=True),
    )
    assert together == apart == [greedy_choices(row) for row in rows] and together[2][0] == 10
    assert [len(choices) for choices in together] == sizes
    top_apart, top_together = (
        top_token_ids_of_rows(rows, 5, together=False),
        top_token_ids_of_rows(rows, 5, together=True),
    )
    assert [t.shape for t in top_together] == [(size, 5) for size in sizes]
    for a, b, row in zip(top_apart, top_together, rows):
        np.testing.assert_array_equal(a[:, 0], b[:, 0])  # the largest: no ties among random floats
        assert (
            set(a.flatten())
            == set(b.flatten())
            == set(torch.topk(row, 5).indices.flatten().tolist())
        )
    assert greedy_choices_of_rows([]) == [] and top_token_ids_of_rows([], 5) == []


def test_inverse_cdf_samples_follow_p() -> None:
    params = SamplingParams(temperature=0.8, top_k=4)
    draws = 20000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = choose_tokens(LOGITS.expand(draws, -1), params, uniforms)
    observed = torch.bincount(torch.tensor(tokens), minlength=5)
    expected = target_probs(LOGITS, params)[0] * draws
    assert observed[4] == 0  # cut by top-k
    assert chisquare(observed[:4].numpy(), expected[:4].numpy()).pvalue > 0.01


def test_uniforms_are_fixed_per_position_and_seed() -> None:
    a, b = PositionUniforms(7), PositionUniforms(7)
    first = a.at([3, 0, 5]).tolist()
    assert a.at([200, 3]).tolist()[1] == first[0]  # drawing further does not move old positions
    assert b.at([0, 3, 5]).tolist() == [first[1], first[0], first[2]]
    assert PositionUniforms(8).at([0]).tolist() != a.at([0]).tolist()


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {
            "temperature": 1e-45
        },  # logits / 1e-45 overflow to inf, softmax to NaN: refused, not sampled
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"seed": -1},
        {"seed": 2**64},  # outside torch.Generator's range
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"frequency_penalty": 2.1},
        {"presence_penalty": -2.5},
        {"presence_penalty": float("nan")},
        {"repetition_penalty": 0},
        {"repetition_penalty": float("inf")},
        {"repetition_penalty": 1e-31},
        {"repetition_penalty": 1e31},  # logits times or over it overflow float32
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {5: 100.5}},
    ],
)
def test_invalid_parameters_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
