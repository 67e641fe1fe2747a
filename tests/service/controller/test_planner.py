"""Cost profile interpolation and the batch-aware tree controller on synthetic curves."""

from __future__ import annotations

import pytest

from drafting import Acceptance, Draft, ScoredDraft
from service.controller.cost_profile import CostProfile, PassShape
from service.controller.planner import (
    PATIENCE,
    PATIENCE_PER_ROW,
    RowCandidates,
    RowTree,
    best_draft_pays,
    plan_trees,
)
from tests.helpers.costs import COMPUTE_BOUND, CPU_LIKE, MEMORY_BOUND, candidates, gpu_like


def choose(
    drafts: list[ScoredDraft], profile: CostProfile, k: int, w: int, context: int = 500
) -> RowTree:
    """The controller's choice for one request alone."""
    plan = plan_trees(
        [RowCandidates(drafts, k, w)],
        lambda s: profile.cost(s.tokens, context),
        PassShape(1),
        0.0,
        budget=k * w,
    )
    return plan.trees[0]


def test_interpolation_and_extrapolation() -> None:
    profile = CostProfile(
        [1, 3], [10, 20], [[1, 3], [3, 9]], [[[1.0, 2.0], [3.0, 4.0]], [[2.0, 8.0], [4.0, 8.0]]]
    )
    assert profile.cost(1, 10) == 1.0
    assert profile.cost(2, 10) == pytest.approx(1.5)  # between sizes
    assert profile.cost(1, 15) == pytest.approx(2.0)  # between context lengths
    assert profile.cost(1, 99) == 3.0  # context clamped
    assert profile.cost(5, 10) == pytest.approx(3.0)  # size extrapolated linearly
    assert profile.slowdown(3, 20) == pytest.approx(4 / 3)
    assert profile.cost(3, 10, rows=3) == pytest.approx(2.0)  # the 3-row table
    assert profile.cost(9, 10, rows=2) == pytest.approx((5.0 + 8.0) / 2)  # between row counts
    assert CostProfile([1], [10], [[4]], [[[2.0]]]).cost(9, 10) == 2.0  # one size measured: flat


def test_each_wide_row_costs_its_own_call() -> None:
    sizes = [[1, 2, 4], [4, 8, 16]]
    equal_rows = [[[1.0, 1.1, 1.2]], [[2.0, 2.4, 3.0]]]  # one context length
    profile = CostProfile([1, 4], [100], sizes, equal_rows, wide_row_seconds=[[0.0], [0.2]])
    assert profile.cost(4, 100, rows=4) == pytest.approx(2.0)
    assert profile.cost(5, 100, rows=4, wide_rows=1) == pytest.approx(2.1 + 0.2)
    assert profile.cost(8, 100, rows=4, wide_rows=4) == pytest.approx(
        2.4 + 4 * 0.2
    )  # a call each, not one padded
    assert profile.cost(3, 100, rows=1, wide_rows=1) == pytest.approx(
        1.15
    )  # one row: the curve itself
    assert profile.wide_row_cost(100, rows=2) == pytest.approx(0.2 / 3)  # between row counts
    assert CostProfile([1, 4], [100], sizes, equal_rows).cost(5, 100, 4, 1) == pytest.approx(
        2.1
    )  # not measured


def test_the_first_node_of_a_row_pays_for_the_row() -> None:
    """Where every row that speculates costs a call of its own, the nodes deepen the likely
    row's tree instead of starting a second, middling row's; a row that is already wide (its
    last prompt chunk) pays no such cost."""
    likely = RowCandidates(candidates(0.9, 0.9, k=1, w=4), 1, 4)
    middling = RowCandidates(candidates(0.5, 0.5, k=1, w=4, first=200), 1, 4)

    def plan(row_seconds: float, middling: RowCandidates = middling):
        def cost(s: PassShape) -> float:
            return 1.0 + 0.05 * (s.tokens - 2) + row_seconds * (s.wide_rows - chunked)

        chunked = int(middling.width > 1)
        return plan_trees(
            [likely, middling], cost, PassShape(1 + middling.width, chunked), 0.0, budget=64
        )

    assert [t.k for t in plan(0.0).trees] == [1, 1]
    assert [t.k for t in plan(0.3).trees] == [1, 0]
    chunk_row = RowCandidates(middling.candidates, 1, 4, width=9)
    assert [t.k for t in plan(0.3, chunk_row).trees] == [1, 1]


def test_memory_bound_curve_gets_large_trees() -> None:
    tree = choose(candidates(0.6, 0.8), MEMORY_BOUND, k=8, w=8)
    assert tree.k == 8 and tree.w == 8
    assert sum(len(d.token_ids) for d in tree.drafts) == 64


def test_compute_bound_curve_gets_small_trees() -> None:
    tree = choose(candidates(0.6, 0.8), COMPUTE_BOUND, k=8, w=8)
    assert 1 <= sum(len(d.token_ids) for d in tree.drafts) <= 3


def test_no_acceptance_means_plain_decoding() -> None:
    for profile in (MEMORY_BOUND, COMPUTE_BOUND, CPU_LIKE):
        tree = choose(candidates(0.0, 0.0), profile, k=8, w=8)
        assert (tree.k, tree.w, tree.drafts) == (0, 0, [])
    assert choose([], MEMORY_BOUND, 8, 8).k == 0  # nothing proposed


def test_speculation_must_beat_plain_by_a_margin() -> None:
    # one draft, tiny acceptance: 1.01 expected tokens for a 0.1% more costly pass
    weak = [ScoredDraft(Draft((5,), "s", 0), Acceptance(0.01, 0.0))]
    assert choose(weak, MEMORY_BOUND, 1, 1).k == 0
    strong = [ScoredDraft(Draft((5,), "s", 0), Acceptance(0.9, 0.0))]
    assert choose(strong, MEMORY_BOUND, 1, 1).k == 1


def test_cpu_curve_prefers_a_few_good_drafts() -> None:
    """With the dev CPU's costs only a long, likely draft pays; weak ones are left out."""
    good_first = [ScoredDraft(Draft((1, 2, 3, 4), "context", 0), Acceptance(0.9, 0.9))]
    tree = choose(good_first + candidates(0.05, 0.1, first=100)[1:], CPU_LIKE, 8, 8)
    assert tree.k == 1 and tree.w == 4
    assert tree.expected_tokens == pytest.approx(1 + 0.9 * (1 - 0.9**4) / 0.1)


def test_shared_prefixes_count_once() -> None:
    shared = [
        ScoredDraft(Draft((1, 2), "a", 0), Acceptance(0.5, 0.5)),
        ScoredDraft(Draft((1, 3), "b", 0), Acceptance(0.4, 0.2)),
    ]
    tree = choose(shared, MEMORY_BOUND, 2, 2)
    assert tree.k == 2 and {d.token_ids for d in tree.drafts} == {(1, 2), (1, 3)}
    # node 1: a's (the better draft holds it); node 2: 0.5·0.5;
    # node 3: continues from node 1, 0.5·0.2
    assert tree.expected_tokens == pytest.approx(1 + 0.5 + 0.25 + 0.10)


def test_caps_hold_per_request() -> None:
    tree = choose(candidates(0.9, 0.9), MEMORY_BOUND, k=3, w=2)
    assert tree.k <= 3 and tree.w <= 2


def test_the_batch_shares_the_pass_where_nodes_pay_most() -> None:
    """Two requests, one copy-heavy and one free text, on a device where every token costs:
    the nodes go to the request whose drafts are likely; a memory-bound device takes both."""
    easy = RowCandidates(candidates(0.9, 0.9, k=2, w=4), 2, 4)
    hard = RowCandidates(candidates(0.05, 0.1, k=2, w=4, first=200), 2, 4)
    costly = plan_trees(
        [easy, hard],
        lambda s: COMPUTE_BOUND.cost(s.tokens, 100) * 0.3,
        PassShape(2),
        0.0,
        budget=64,
    )
    assert costly.trees[0].k >= 1 and costly.trees[1].k == 0
    cheap = plan_trees(
        [easy, hard], lambda s: MEMORY_BOUND.cost(s.tokens, 100), PassShape(2), 0.0, budget=64
    )
    assert cheap.trees[0].k == 2 and cheap.trees[1].k >= 1


def test_a_large_batch_on_a_compute_bound_device_speculates_less() -> None:
    """Per-row acceptance alike; the pass already holds many rows, so a node's marginal cost
    is a bigger share of what it buys: fewer nodes per row than for one row alone."""

    def nodes_per_row(rows: int) -> float:
        row = RowCandidates(candidates(0.5, 0.6, k=4, w=4), 4, 4)
        cost = lambda s: 0.05 + 0.01 * s.tokens  # noqa: E731  a pass of n tokens, compute-bound beyond a base
        plan = plan_trees([row] * rows, cost, PassShape(rows), 0.0, budget=1024)
        return (plan.tokens - rows) / rows

    assert nodes_per_row(1) > nodes_per_row(32)


def test_a_probe_speculates_even_when_the_forecast_says_plain() -> None:
    row = RowCandidates(candidates(0.3, 0.3), 4, 4, probe=True)
    plan = plan_trees(
        [row], lambda s: COMPUTE_BOUND.cost(s.tokens, 100), PassShape(1), 0.0, budget=16
    )
    assert plan.trees[0].k >= 1 and plan.tokens > 1  # the best speculative plan, though plain wins
    assert plan.probed
    no_probe = plan_trees(
        [RowCandidates(candidates(0.3, 0.3), 4, 4)],
        lambda s: COMPUTE_BOUND.cost(s.tokens, 100),
        PassShape(1),
        0.0,
        16,
    )
    assert no_probe.tokens == 1 and not no_probe.probed


def test_a_prompt_chunk_does_not_make_nodes_look_cheap() -> None:
    """A pass carrying 100 prompt tokens is slow whatever it decodes; priced against that
    pass, a node that costs more than it buys would still raise its tokens per second. Priced
    without the chunk's seconds, the node loses to plain decoding, as it does in any pass."""
    row = RowCandidates(candidates(0.5, 0.5, k=1, w=1), 1, 1)
    cost = lambda s: 0.01 + 0.1 * s.tokens  # noqa: E731  compute-bound: a node costs 0.1 s for 0.5 tokens
    with_chunk = PassShape(101, 1)  # the decoding row's root and another request's chunk
    counted_in = plan_trees([row], cost, with_chunk, 0.0, budget=8)
    assert counted_in.tokens == 102  # 1.5 tokens in 10.21 s beat 1 token in 10.11 s
    chunk_seconds = cost(with_chunk) - cost(PassShape(1))
    priced_apart = plan_trees([row], cost, with_chunk, 0.0, budget=8, prefill_seconds=chunk_seconds)
    assert priced_apart.tokens == 101 and priced_apart.trees[0].drafts == []
    assert priced_apart.seconds == pytest.approx(
        cost(with_chunk)
    )  # the forecast is still the whole pass


def test_one_row_probes_per_pass() -> None:
    """Rows that come due together probe one pass each, the first (oldest) row first."""
    due = RowCandidates(candidates(0.3, 0.3), 4, 4, probe=True)
    rows = [RowCandidates(candidates(0.3, 0.3), 4, 4), due, due, due]
    plan = plan_trees(
        rows, lambda s: COMPUTE_BOUND.cost(s.tokens, 100), PassShape(4), 0.0, budget=64
    )
    assert [tree.k >= 1 for tree in plan.trees] == [False, True, False, False]
    assert plan.tokens > 4


def test_the_budget_caps_the_added_nodes() -> None:
    rows = [RowCandidates(candidates(0.9, 0.9), 8, 8)] * 3
    plan = plan_trees(
        rows, lambda s: MEMORY_BOUND.cost(s.tokens, 100), PassShape(3), 0.0, budget=10
    )
    assert plan.tokens == 13


def test_drafting_time_counts_so_a_slow_accurate_draft_loses_to_a_fast_one() -> None:
    """Same acceptance for both drafts (disjoint first tokens); one costs drafting time."""
    slow = ScoredDraft(
        Draft((1, 2, 3, 4), "self_draft", 0), Acceptance(0.8, 0.8), seconds_per_token=0.5
    )
    fast = ScoredDraft(Draft((5, 6, 7, 8), "context", 0), Acceptance(0.6, 0.8))
    tree = choose([slow, fast], MEMORY_BOUND, 2, 4)
    assert {d.strategy for d in tree.drafts} == {
        "context"
    }  # half a pass per token: more than its gain
    free = choose([ScoredDraft(slow.draft, slow.acceptance), fast], MEMORY_BOUND, 2, 4)
    assert {d.strategy for d in free.drafts} == {"self_draft", "context"}
    too_slow = choose(
        [ScoredDraft(slow.draft, slow.acceptance, seconds_per_token=1.0)], MEMORY_BOUND, 1, 4
    )
    assert too_slow.drafts == []  # nothing beats plain decoding


def test_a_cheap_child_never_comes_before_its_costly_parent() -> None:
    shared = [
        ScoredDraft(Draft((1, 2), "self_draft", 0), Acceptance(0.9, 0.9), seconds_per_token=0.01),
        ScoredDraft(Draft((1, 3, 4), "context", 0), Acceptance(0.8, 0.9)),
    ]
    plan = plan_trees(
        [RowCandidates(shared, 2, 3)],
        lambda s: MEMORY_BOUND.cost(s.tokens, 100),
        PassShape(1),
        0.0,
        budget=2,
    )
    assert [d.token_ids for d in plan.trees[0].drafts] == [(1, 3)]  # node (1,) first, then (1, 3)
    assert plan.tokens == 3


def test_the_planner_stops_pricing_once_more_nodes_stop_paying() -> None:
    """Sixteen requests of 8 × 8 candidates where every token costs: the plan is chosen
    among the first nodes, and the planner does not price all 1024 of them."""
    calls = []

    def cost(s: PassShape) -> float:
        calls.append(s)
        return 0.05 + 0.005 * s.tokens

    rows = [RowCandidates(candidates(0.9, 0.9, first=1000 * r), 8, 8) for r in range(16)]
    plan = plan_trees(rows, cost, PassShape(16), 0.0, budget=1024)
    assert plan.tokens > 16 and len(calls) < 200


def test_a_lone_row_is_searched_a_short_way_past_its_best_plan() -> None:
    """One request of 8 x 8 candidates where every token costs: past its best plan the
    planner prices `PATIENCE_PER_ROW` more nodes, not `PATIENCE` (a lone row's rate dips only
    at its first node), and the plan is the one an exhaustive search finds."""
    priced = []

    def cost(s: PassShape) -> float:
        priced.append(s.tokens)
        return 0.05 + 0.005 * s.tokens

    row = RowCandidates(candidates(0.9, 0.9), 8, 8)
    plan = plan_trees([row], cost, PassShape(1), 0.0, budget=64)
    assert (
        1 < plan.tokens < 1 + 64 - PATIENCE
    )  # the best plan leaves more than PATIENCE nodes to look at
    last = plan.tokens + PATIENCE_PER_ROW  # the search went this far past it, no further
    assert last in priced and last + 1 not in priced
    with pytest.MonkeyPatch.context() as patch:  # searched to the end, the same plan
        patch.setattr("service.controller.planner.PATIENCE_PER_ROW", 64)
        patch.setattr("service.controller.planner.PATIENCE", 64)
        assert plan_trees([row], cost, PassShape(1), 0.0, budget=64) == plan


def test_host_work_a_speculating_row_adds_keeps_a_large_batch_plain_where_the_pass_is_flat() -> (
    None
):
    """A GPU-like pass (64 rows, 19 ms whatever the tokens): on the pass alone every node is
    nearly free, so middling drafts of every row speculate; priced with the host work each
    speculating row adds (0.3 ms, above a row's ~0.3 ms share of the pass), only a row whose
    drafts are likely to be accepted still does."""
    cost = lambda s: 0.019 + 1e-6 * s.tokens  # noqa: E731
    middling = [
        RowCandidates(candidates(0.3, 0.4, k=2, w=3, first=100 * i), 2, 3) for i in range(1, 64)
    ]
    likely = RowCandidates(candidates(0.95, 0.95, k=3, w=6), 3, 6)
    rows = [likely, *middling]

    def speculating(row_host_seconds: float) -> list[int]:
        plan = plan_trees(
            rows, cost, PassShape(64), 0.0, budget=1024, row_host_seconds=row_host_seconds
        )
        return [i for i, tree in enumerate(plan.trees) if tree.k > 0]

    assert len(speculating(0.0)) == 64
    assert speculating(0.0003) == [0]
    plan = plan_trees(rows, cost, PassShape(64), 0.0, budget=1024, row_host_seconds=0.0003)
    assert plan.trees[0].k == 3  # its branches share the row's host work: charged once
    assert plan.seconds == pytest.approx(
        cost(PassShape(plan.tokens)) + 0.0003
    )  # the forecast counts it


def test_a_sure_draft_pays_unless_a_wide_row_costs_more_than_its_tokens() -> None:
    """A draft sure to be accepted pays in a small batch; in a batch of 64 one-token rows, where
    one wide row costs as much as 10 of them, not even 6 sure tokens do."""

    def pays(rows: int, wide: float, depth: int = 6, host: float = 0.0) -> bool:
        profile = gpu_like(rows, wide)
        return best_draft_pays(
            lambda s: profile.cost(s.tokens, 100, rows, s.wide_rows),
            PassShape(rows),
            rows,
            1,
            depth,
            row_host_seconds=host,
        )

    assert pays(4, 0.0022) and pays(64, 0.0005)
    assert not pays(64, 0.0022)
    assert not pays(4, 0.0, host=0.1)  # the row's own host work counts too
    assert not pays(4, 0.0, depth=0)


@pytest.mark.parametrize(
    "acceptance", [Acceptance(1.0, 1.0), Acceptance(0.9, 0.8), Acceptance(0.6, 0.5)]
)
@pytest.mark.parametrize(
    "rows, wide", [(64, 0.0022), (16, 0.006), (64, 0.0012), (4, 0.02), (16, 0.0), (4, 0.0)]
)
def test_where_the_best_draft_does_not_pay_the_planner_takes_no_node_of_any_row(
    rows: int, wide: float, acceptance: Acceptance
) -> None:
    """The bound the engine tests before drafting holds for the planner's own choice: every row
    offered a draft as good as the best one known, still none taken; and where one row's would
    pay, the planner takes it."""
    profile = gpu_like(rows, wide)
    cost = lambda s: profile.cost(s.tokens, 100, rows, s.wide_rows)  # noqa: E731
    best = [
        RowCandidates(
            [ScoredDraft(Draft(tuple(range(100 * r, 100 * r + 6)), "s", 0), acceptance)], 1, 6
        )
        for r in range(rows)
    ]
    plan = plan_trees(best, cost, PassShape(rows), 0.0, budget=1024, min_gain=1.0)
    assert best_draft_pays(cost, PassShape(rows), rows, 1, 6, acceptance=acceptance) == (
        plan.tokens > rows
    )


def test_a_draft_less_than_sure_pays_only_where_its_expected_tokens_do() -> None:
    """On the CPU-like curve a sure draft pays in a pass of one row; one accepted a fifth of
    the time, whose tokens cost more than they bring, does not."""
    cost = lambda s: CPU_LIKE.cost(s.tokens, 100, 1, s.wide_rows)  # noqa: E731
    assert best_draft_pays(cost, PassShape(1), 1, 1, 6)
    assert not best_draft_pays(cost, PassShape(1), 1, 1, 6, acceptance=Acceptance(0.2, 0.2))
