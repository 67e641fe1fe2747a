"""The speculation policy inside an engine: what it plans for the auto rows each step."""

from __future__ import annotations

from drafting import Acceptance
from service.controller.planner import RowCandidates, plan_trees
from service.engine.params import GenerationParams, SpeculationParams
from tests.helpers.batch import PROMPTS
from tests.helpers.costs import linear_profile
from tests.helpers.engines import make_engine, reference_greedy


def test_a_step_where_no_auto_row_drafted_is_planned_as_the_planner_plans_rows_without_drafts(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    """Four auto requests the gate keeps from drafting (each token costs as much again as the
    pass's first, the best draft known is accepted a fifth of the time): every step after the
    first is quiet, and its plan (trees, tokens, forecast seconds) is `plan_trees`' for rows
    without candidates, each row's tree its root; the answers are plain decoding's."""
    engine = make_engine(tiny_runner, tiny_tables)
    engine.profile = linear_profile(0.01, 0.01)
    engine.mixer.best_acceptance = lambda w: Acceptance(0.2, 0.2)  # type: ignore[method-assign]
    policy, plan, trees = engine.policy, engine.policy.plan, engine.policy.trees
    quiet_steps, taken = [], []

    def checked(rows, speculating, budget, pricing):
        decided = trees(rows, speculating, budget, pricing)
        auto = [row for row in rows if row.decoding and policy.is_auto(row.request)]
        if any(row in speculating for row in auto):
            return decided
        cost, fixed, prefill_seconds = pricing or policy.pricing(rows, set(auto))
        expected = plan_trees(
            [
                RowCandidates([], row.request.speculation.k, row.request.speculation.w)
                for row in auto
            ],
            cost,
            fixed,
            sum(1 for r in rows if r.tree is not None),
            budget,
            prefill_seconds=prefill_seconds,
        )
        assert taken[-1] == expected
        assert all(
            row.tree is not None and row.tree.num_nodes == 1 for row in decided if row.decoding
        )
        quiet_steps.append(len(auto))
        return decided

    def recorded(*args):
        taken.append(plan(*args))
        return taken[-1]

    policy.trees, policy.plan = checked, recorded  # type: ignore[method-assign]
    params = GenerationParams(12, speculation=SpeculationParams(6, 5, "auto"))
    requests = [engine.add_request(prompt, params) for prompt in PROMPTS[:4]]
    while engine.has_work:
        engine.step()
    assert len(quiet_steps) >= 10 and max(quiet_steps) == 4
    for request in requests:
        assert request.output_ids == reference_greedy(tiny_model, request.prompt_ids, 12)
