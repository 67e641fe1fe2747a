"""Forecasts corrected by what happens — and auto mode that recovers when conditions change.

The scenarios run the controller and the calibration round after round against a simulated
cost source (true seconds of a pass of n tokens at round t), the way the engine drives them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from service.controller.calibration import (
    HOST_WINDOW,
    PROBE_EVERY,
    PROBE_MAX_EVERY,
    QUIET_MAX_EVERY,
    QUIET_ROUNDS,
    SHAPE_DECAY,
    SHAPE_PRIOR_ROUNDS,
    Calibration,
    Ratio,
    shape_bucket,
)
from service.controller.cost_profile import CostProfile, PassShape
from service.controller.planner import RowCandidates, plan_trees
from tests.helpers.costs import CPU_LIKE, candidates

# drafts that pay on the CPU-like curve: about 2.5 expected tokens for a small tree
DRAFTS = candidates(0.9, 0.8, k=2, w=4)

TrueCost = Callable[[int, int], float]  # (tokens, round) -> seconds


def simulate(profile: CostProfile, true_cost: TrueCost, rounds: int) -> list[int]:
    """Drive one auto request for `rounds` rounds; the tree size chosen at each round."""
    shared = Calibration()
    request = shared.for_request()
    chosen = []
    for t in range(rounds):
        row = RowCandidates(DRAFTS, 2, 4, probe=request.due_for_probe)
        # as the engine does
        budget = 0 if shared.plain_is_stale(1) and shared.level.rounds > 0 else 8
        plan = plan_trees(
            [row],
            lambda s: profile.cost(s.tokens, 100) * shared.shape_factor(s.tokens),
            PassShape(1),
            0.0,
            budget,
        )
        # acceptance as forecast: the pass-cost side alone
        request.observe_round(speculated=plan.tokens > 1)
        shared.observe_pass(plan.tokens, profile.cost(plan.tokens, 100), true_cost(plan.tokens, t))
        chosen.append(plan.tokens)
    return chosen


def true_profile(n: int) -> float:
    return CPU_LIKE.cost(n, 100)


def test_without_disturbance_auto_speculates_but_for_rare_plain_probes() -> None:
    sizes = simulate(CPU_LIKE, lambda n, t: true_profile(n), 100)
    assert sizes.count(1) <= 100 // PROBE_EVERY


def test_a_uniform_load_spike_changes_no_decision() -> None:
    """Three busy loops slow every pass alike: the load level absorbs it."""
    spike = lambda n, t: true_profile(n) * (3.0 if 20 <= t < 60 else 1.0)  # noqa: E731
    sizes = simulate(CPU_LIKE, spike, 120)
    assert sizes.count(1) <= 120 // PROBE_EVERY


def test_a_spike_that_hits_speculation_hardest_is_recovered_from_within_a_bounded_number_of_rounds() -> (  # noqa: E501
    None
):
    """During the spike trees cost 4× their price and plain passes 1×: auto stops speculating.
    After it ends, the unused sizes' factors decay back and probes re-measure them."""
    end = 60
    spike = lambda n, t: true_profile(n) * (4.0 if 20 <= t < end and n > 1 else 1.0)  # noqa: E731
    sizes = simulate(CPU_LIKE, spike, 200)
    print("rounds speculating during the spike's second half:", sum(s > 1 for s in sizes[40:end]))
    assert sizes[40:end].count(1) > (end - 40) // 2  # plain probes showed that trees got dear
    recovered = next(t for t in range(end, 200) if sum(s > 1 for s in sizes[t : t + 20]) >= 18)
    print(f"speculating steadily again {recovered - end} rounds after the spike")
    assert recovered - end <= 40
    assert sizes[end + 40 :].count(1) <= (200 - end - 40) // PROBE_EVERY + 1


def test_a_slow_drift_keeps_the_right_choice() -> None:
    drift = lambda n, t: true_profile(n) * (1.0 + t / 300)  # noqa: E731  twice as slow by the end
    sizes = simulate(CPU_LIKE, drift, 300)
    assert sizes.count(1) <= 300 // PROBE_EVERY


def test_a_profile_measured_under_load_is_corrected_by_probes() -> None:
    """The profile says trees cost 3× a plain pass (measured while something else ran); truly
    they cost what CPU_LIKE says. Auto starts plain, probes, and learns the truth."""
    pessimistic = CostProfile(
        [1],
        [100],
        [CPU_LIKE.tree_sizes[0]],
        [[[s * (1 if i == 0 else 3) for i, s in enumerate(CPU_LIKE.seconds[0][0])]]],
    )
    sizes = simulate(pessimistic, lambda n, t: true_profile(n), 200)
    assert sizes[0] == 1  # believed the profile at first
    switched = next(t for t in range(200) if sum(s > 1 for s in sizes[t : t + 20]) >= 18)
    print(f"speculating steadily from round {switched}")
    assert switched <= 4 * PROBE_EVERY
    assert sizes[switched:].count(1) <= (200 - switched) // PROBE_EVERY + 1


def test_steady_disagreement_with_the_profile_asks_for_a_new_one() -> None:
    shared = Calibration()
    for _ in range(20):
        shared.observe_pass(2, 0.1, 0.1)
    assert not shared.drifted()
    for _ in range(20):
        shared.observe_pass(2, 0.1, 0.1)
        shared.observe_pass(9, 0.1, 0.3)  # 9-token passes cost 3× their price, plain ones do not
    assert shared.drifted()
    shared.reset_costs()
    assert not shared.drifted() and shared.shape_factor(9) == 1.0


def test_a_ratio_starts_at_its_prior_and_converges_to_what_happens() -> None:
    ratio = Ratio(decay=0.98, prior_rounds=4.0)
    assert ratio.factor(prior=0.8) == 0.8
    ratio.observe(predicted=2.0, realized=1.0)
    assert 0.5 < ratio.factor() < 1.0  # one round moves it only part of the way
    for _ in range(200):
        ratio.observe(predicted=2.0, realized=1.0)
    assert ratio.factor() == pytest.approx(0.5, abs=0.05)  # the prior keeps a little weight
    for _ in range(400):  # the horizon is finite: a new regime takes over
        ratio.observe(predicted=2.0, realized=2.0)
    assert ratio.factor() == pytest.approx(1.0, abs=0.02)


def test_shape_ratios_faded_lazily_equal_every_ratio_faded_on_every_pass() -> None:
    shared = Calibration()
    eager = [Ratio(SHAPE_DECAY, SHAPE_PRIOR_ROUNDS) for _ in shared.shapes]
    passes = [(1, 1), (3, 1), (1, 1), (9, 4), (40, 16), (1, 1), (3, 1), (300, 64)] * 5
    for index, (tokens, rows) in enumerate(passes):
        shared.observe_pass(tokens, 0.01, 0.01 + 0.001 * index, rows)  # a level that drifts up
        for ratio in eager:
            ratio.fade()
        eager[shape_bucket(tokens, rows)].add(0.01 * shared.level.factor(), 0.01 + 0.001 * index)
        if index % 7 == 0:  # read now and then, as the controller does
            assert shared.shape_factor(3) == pytest.approx(eager[shape_bucket(3, 1)].factor())
    for lazy, ratio in zip(shared.shapes, eager, strict=True):
        assert [lazy.predicted, lazy.realized, lazy.rounds] == pytest.approx(
            [ratio.predicted, ratio.realized, ratio.rounds]
        )
    assert not shared.plain_is_stale(1) and shared.plain_is_stale(16, 16)  # seen lately; never seen


def test_probes_that_find_plain_better_back_off_and_a_chosen_round_resets_them() -> None:
    """A request whose drafts never pay probes after 16, 32, 64, 128, 128 ... plain rounds; once
    the forecast itself speculates again, the wait is back to 16."""
    request = Calibration().for_request()
    waits = []
    for _ in range(6):
        plain = 0
        while not request.due_for_probe:
            request.observe_round(speculated=False)
            plain += 1
        waits.append(plain)
        request.observe_round(speculated=True)  # the probe
    assert waits == [
        PROBE_EVERY,
        2 * PROBE_EVERY,
        4 * PROBE_EVERY,
        8 * PROBE_EVERY,
        PROBE_MAX_EVERY,
        PROBE_MAX_EVERY,
    ]
    for _ in range(5):
        request.observe_round(speculated=False)
    request.observe_round(speculated=True)  # chosen by the forecast, not due
    assert request.probe_every == PROBE_EVERY


def test_a_request_kept_plain_is_drafted_only_every_few_rounds_until_it_speculates() -> None:
    request = Calibration().for_request()
    drafted = []
    for round_number in range(PROBE_EVERY + 2):
        drafted.append(request.drafts_this_round)
        request.observe_round(speculated=False)
    after = QUIET_ROUNDS + 1
    assert drafted[:after] == [True] * after  # at first every round, then one in 4, one in 8
    assert [r for r in range(after, PROBE_EVERY) if drafted[r]] == [8]
    assert (
        request.due_for_probe and drafted[PROBE_EVERY] and drafted[PROBE_EVERY + 1]
    )  # a probe is drafted
    request.observe_round(speculated=True)
    assert request.drafts_this_round and request.plain_rounds == 0  # speculating: every round again


def test_quiet_rounds_thin_out_to_one_in_quiet_max_every() -> None:
    """Past its probes' reach (the engine-wide gate shut), a request kept plain is drafted at
    4 and 8 plain rounds, then every 16th; `drafts_next_round` foretells each of them."""
    shared = Calibration()
    request = shared.for_request()
    drafted, foretold = [], []
    for _ in range(80):
        shared.count_pass(probed=True)  # another request's probe: the gate stays shut
        drafted.append(request.drafts_this_round)
        foretold.append(request.drafts_next_round(speculates=False))
        request.observe_round(speculated=False)
    assert [r for r in range(QUIET_ROUNDS, 80) if drafted[r]] == [
        4,
        8,
        *range(16, 80, QUIET_MAX_EVERY),
    ]
    assert foretold[:-1] == drafted[1:]
    assert request.drafts_next_round(speculates=True)  # a round that speculates: every round again


def test_a_request_due_for_a_probe_the_engine_holds_back_stays_quiet() -> None:
    """Another request took this pass's probe: this one, due too, keeps its quiet rounds
    until the engine-wide gate opens again."""
    shared = Calibration()
    request = shared.for_request()
    for _ in range(PROBE_EVERY):
        request.observe_round(speculated=False)
    shared.count_pass(probed=True)  # someone else's probe
    drafted = []
    for _ in range(PROBE_EVERY):
        assert request.due_for_probe
        drafted.append(request.drafts_this_round)
        request.observe_round(speculated=False)
        shared.count_pass(probed=False)
    assert drafted == [(PROBE_EVERY + r) % QUIET_MAX_EVERY == 0 for r in range(PROBE_EVERY)]
    assert shared.may_probe and request.drafts_this_round  # the gate is open: drafted for its probe


def test_the_engine_probes_at_most_once_every_probe_every_passes() -> None:
    shared = Calibration()
    assert shared.may_probe
    shared.count_pass(probed=True)
    for _ in range(PROBE_EVERY):
        assert not shared.may_probe
        shared.count_pass(probed=False)
    assert shared.may_probe


def test_a_shape_factor_learned_at_one_batch_size_does_not_price_another() -> None:
    """Trees of 4 tokens in one row (C=1) cost twice their price here; four one-token rows
    (plain decoding at C=4) are a pass of 4 tokens too, but the profile's word stands for them."""
    shared = Calibration()
    for _ in range(20):
        shared.observe_pass(1, 0.1, 0.1)
        shared.observe_pass(4, 0.1, 0.2)
    assert shared.shape_factor(4) > 1.2 * shared.shape_factor(1)
    assert shared.shape_factor(4, rows=4) == 1.0
    for _ in range(20):
        shared.observe_pass(4, 0.1, 0.1, rows=4)
        shared.observe_pass(8, 0.1, 0.1, rows=4)
    assert shared.shape_factor(4, rows=4) == pytest.approx(
        1.0, abs=0.01
    )  # as profiled, once observed
    assert shared.shape_factor(8, rows=4) == pytest.approx(1.0, abs=0.01)


def test_a_shape_factor_holds_for_the_sizes_of_its_bucket_only() -> None:
    """Passes of 3 tokens took about four times what passes of 600 did, both priced alike:
    sizes 3 and 4 share a bucket (up to 4), 2 and 5 do not; the last bucket holds every size
    above the bound before it (256)."""
    shared = Calibration()
    for _ in range(20):
        shared.observe_pass(3, 0.1, 0.2)
        shared.observe_pass(600, 0.1, 0.05)
    dear, cheap = shared.shape_factor(3), shared.shape_factor(600)
    assert (
        dear
        == shared.shape_factor(4)
        > 1.0
        > cheap
        == shared.shape_factor(257)
        == shared.shape_factor(5000)
    )
    assert dear / cheap > 2.0
    assert shared.shape_factor(2) == shared.shape_factor(5) == shared.shape_factor(256) == 1.0
    assert shared.shape_factor(4, rows=2) == 1.0  # another row bucket


def test_host_cost_is_the_median_per_drafted_row_so_a_one_off_pause_does_not_price_drafts_out() -> (
    None
):
    host = Calibration().host
    assert host.row_seconds == 0.0  # nothing seen: the pass alone prices a node
    host.observe(0.004, rows=1)  # a request's first drafting
    host.observe(0.0, rows=0)  # a step that drafted no row says nothing
    for _ in range(8):
        host.observe(0.0006, rows=4)
    assert host.row_seconds == pytest.approx(0.00015)
    for _ in range(HOST_WINDOW):
        host.observe(0.0004, rows=1)
    assert host.row_seconds == pytest.approx(0.0004)  # a window: what drafting costs now
