"""Cost profile interpolation and the (k, w) controller on synthetic curves and statistics."""

from __future__ import annotations

import pytest

from drafting import Acceptance, Draft, ScoredDraft
from service.regime import CostProfile, choose_shape

SIZES = [1, 2, 4, 8, 16, 32, 64]


def flat_profile(slope: float) -> CostProfile:
    """T(n) = 1 + slope·(n − 1) seconds at every context length."""
    row = [1.0 + slope * (n - 1) for n in SIZES]
    return CostProfile(SIZES, [100, 1000], [row, row])


MEMORY_BOUND = flat_profile(0.001)  # a GPU below its knee: 64 tokens cost 6% more than 1
COMPUTE_BOUND = flat_profile(0.5)  # every extra token costs half a pass
CPU_LIKE = CostProfile(SIZES, [100], [[0.110, 0.165, 0.20, 0.23, 0.30, 0.37, 0.55]])


def candidates(p: float, c: float, k: int = 8, w: int = 8) -> list[ScoredDraft]:
    """k disjoint drafts (distinct first tokens) of w tokens; rank r accepted with p/(r+1)."""
    return [
        ScoredDraft(Draft(tuple(range(10 * r + 1, 10 * r + 1 + w)), "s", r), Acceptance(p / (r + 1), c))
        for r in range(k)
    ]


def test_interpolation_and_extrapolation() -> None:
    profile = CostProfile([1, 3], [10, 20], [[1.0, 2.0], [3.0, 4.0]])
    assert profile.cost(1, 10) == 1.0
    assert profile.cost(2, 10) == pytest.approx(1.5)  # between sizes
    assert profile.cost(1, 15) == pytest.approx(2.0)  # between context lengths
    assert profile.cost(1, 99) == 3.0  # context clamped
    assert profile.cost(5, 10) == pytest.approx(3.0)  # size extrapolated linearly
    assert profile.slowdown(3, 20) == pytest.approx(4 / 3)


def test_memory_bound_curve_gets_large_trees() -> None:
    shape = choose_shape(candidates(0.6, 0.8), MEMORY_BOUND, 500, k_max=8, w_max=8)
    assert shape.k == 8 and shape.w == 8
    assert shape.forecast.tree_nodes == 65


def test_compute_bound_curve_gets_small_trees() -> None:
    shape = choose_shape(candidates(0.6, 0.8), COMPUTE_BOUND, 500, k_max=8, w_max=8)
    assert 1 <= shape.k * shape.w <= 3


def test_no_acceptance_means_plain_decoding() -> None:
    for profile in (MEMORY_BOUND, COMPUTE_BOUND, CPU_LIKE):
        shape = choose_shape(candidates(0.0, 0.0), profile, 500, k_max=8, w_max=8)
        assert (shape.k, shape.w, shape.drafts) == (0, 0, [])
    assert choose_shape([], MEMORY_BOUND, 500, 8, 8).k == 0  # nothing proposed


def test_speculation_must_beat_plain_by_a_margin() -> None:
    # one draft, tiny acceptance: 1.01 expected tokens for a 1% more costly pass
    weak = [ScoredDraft(Draft((5,), "s", 0), Acceptance(0.02, 0.0))]
    assert choose_shape(weak, MEMORY_BOUND, 100, 1, 1).k == 0
    strong = [ScoredDraft(Draft((5,), "s", 0), Acceptance(0.9, 0.0))]
    assert choose_shape(strong, MEMORY_BOUND, 100, 1, 1).k == 1


def test_cpu_curve_prefers_a_few_good_drafts() -> None:
    """With the dev CPU's costs, an 8-node tree needs > 2.1 tokens/pass to pay."""
    good_first = [ScoredDraft(Draft((1, 2, 3, 4), "context", 0), Acceptance(0.9, 0.9))]
    shape = choose_shape(good_first + candidates(0.05, 0.1)[1:], CPU_LIKE, 100, 8, 8)
    assert shape.k == 1 and shape.w == 4
    forecast = shape.forecast
    assert forecast.expected_tokens == pytest.approx(1 + 0.9 * (1 - 0.9**4) / 0.1)


def test_shared_prefixes_count_once() -> None:
    shared = [
        ScoredDraft(Draft((1, 2), "a", 0), Acceptance(0.5, 0.5)),
        ScoredDraft(Draft((1, 3), "b", 0), Acceptance(0.4, 0.2)),
    ]
    shape = choose_shape(shared, MEMORY_BOUND, 100, 2, 2)
    assert shape.k == 2 and shape.forecast.tree_nodes == 4  # root, 1, 2, 3
    # node 1: max(0.5, 0.4); node 2: 0.5·0.5; node 3: 0.4·0.2
    assert shape.forecast.expected_tokens == pytest.approx(1 + 0.5 + 0.25 + 0.08)
