"""The speculation policy of each step: which rows draft, and every decoding row's tree.

The engine hands over the step's rows and gets them back with their trees (`trees`); it never
decides how much to speculate itself. Fixed-mode rows draft their configured shape, auto-mode
rows the trees that buy the most tokens per second (the controller's `plan_trees`, priced by
the cost profile as the calibration corrects it), plain rows none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from service.controller.calibration import Calibration
from service.controller.cost_profile import CostProfile, PassCost, PassShape
from service.controller.planner import (
    PLAIN,
    RowCandidates,
    RowTree,
    TreePlan,
    best_draft_pays,
    plan_trees,
)
from service.engine.request import Request
from service.engine.step_row import StepRow
from service.model.tree import build_tree

# The controller's price of a pass shape, the pass's shape as it stands, its prompt chunks' part
Pricing = tuple[Callable[[PassShape], float], PassShape, float]


def pass_shape(widths: Sequence[int]) -> PassShape:
    """A pass whose rows bring `widths` tokens each, as the cost profile prices it."""
    return PassShape(sum(widths), sum(1 for w in widths if w > 1))


class SpeculationPolicy:
    """Decides, every step, which rows draft and the tree of every decoding row."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self.profile: CostProfile | None = None  # set once measured; auto mode needs it
        self.calibration = Calibration()  # how far auto mode's forecasts fall from what happens
        # `pass_cost`'s last answer
        self._last_cost: tuple[float, int, CostProfile, PassCost] | None = None

    # -- who drafts -----------------------------------------------------------------------

    def is_auto(self, request: Request) -> bool:
        """The controller chooses this request's trees (auto mode, once the profile exists)."""
        spec = request.speculation
        return spec.mode == "auto" and spec.k > 0 and self.profile is not None

    def drafts_this_step(self, request: Request) -> bool:
        """Whether the request drafts this step: fixed mode while a draft fits its budget; auto
        mode unless it has been plain for a while and this is not one of its drafting rounds
        (`RequestCalibration.drafts_this_round`)."""
        spec = request.speculation
        if self.is_auto(request):
            return request.calibration.drafts_this_round
        return spec.mode == "fixed" and spec.k > 0 and self.max_depth(request, spec.w) > 0

    def drafts_next_round(self, row: StepRow) -> bool:
        """Whether the row's request will be drafted next round (as far as this round tells):
        fixed mode always, auto mode as its calibration says after this round's choice."""
        spec = row.request.speculation
        if self.is_auto(row.request):
            speculates = row.tree is not None and row.tree.num_nodes > 1
            return row.request.calibration.drafts_next_round(speculates)
        return spec.mode == "fixed" and spec.k > 0

    def max_depth(self, request: Request, w: int) -> int:
        """The deepest tree worth building for `request`: a round commits at most depth + 1
        tokens, so nodes past its remaining budget would be discarded, and node d sits at
        position context_length - 1 + d, which must stay inside the model's context."""
        return max(min(w, request.token_budget - 1, self.max_context - request.context_length), 0)

    def gate(self, rows: Sequence[StepRow], budget: int) -> tuple[list[StepRow], Pricing | None]:
        """The decoding rows that draft this step, and the pass's pricing when auto rows asked
        for it (taken before any row drafts, so every decoding row counts as its root).

        An auto row drafts only where the best draft known so far (the mixer's best estimate
        over all requests, `Mixer.best_acceptance`), in the auto row cheapest to grow, would
        beat plain decoding in this pass (`planner.best_draft_pays`) — but for one row due for
        a probe when the probe gate is open (a probe re-measures what the forecast believes,
        the pass's costs and the drafts' acceptance included)."""
        decoding = [row for row in rows if row.decoding]
        speculating = [row for row in decoding if self.drafts_this_step(row.request)]
        drafting = [row for row in speculating if self.is_auto(row.request)]
        if not drafting:
            return speculating, None
        pricing = self.pricing(rows, set(decoding))
        cost, fixed, prefill_seconds = pricing
        depth = max(self.max_depth(row.request, row.request.speculation.w) for row in drafting)
        best = drafting[0].request.drafts.mixer.best_acceptance(depth)  # one mixer per engine
        if budget > 0 and best_draft_pays(
            cost,
            fixed,
            len(decoding),
            max(row.width + 1 for row in drafting),
            depth,
            prefill_seconds,
            self.calibration.host.row_seconds,
            best,
        ):
            return speculating, pricing
        prober = next(
            (
                row
                for row in drafting
                if row.request.calibration.due_for_probe and self.calibration.may_probe
            ),
            None,
        )
        return [
            row for row in speculating if not self.is_auto(row.request) or row is prober
        ], pricing

    # -- the trees ------------------------------------------------------------------------

    def trees(
        self,
        rows: Sequence[StepRow],
        speculating: Collection[StepRow],
        budget: int,
        pricing: Pricing | None,
    ) -> list[StepRow]:
        """The step's rows, each decoding one with its tree: a fixed-mode row's drafts while the
        pass has room for them (else its root alone), the auto rows' as the controller plans
        them jointly (`plan`), a plain row's root. `speculating` and `pricing`: `gate`'s."""
        decided: list[StepRow] = []
        auto: list[StepRow] = []
        for row in rows:
            if not row.decoding:
                decided.append(row)
            elif self.is_auto(row.request):
                auto.append(row)
                decided.append(row)
            else:
                decided.append(self._fixed_tree(row, row in speculating, budget))
                budget -= decided[-1].tree.num_nodes - 1  # type: ignore[union-attr]
        if not auto:
            return decided
        # fixed-mode trees that grew the pass make the gate's pricing stale
        grown = any(row.tree is not None and row.tree.num_nodes > 1 for row in decided)
        plan = self.plan(auto, decided, budget, set(speculating), None if grown else pricing)
        chosen = dict(zip(auto, plan.trees))  # rows compare by identity
        return [
            self._auto_tree(row, chosen[row], plan) if row in chosen else row for row in decided
        ]

    def _fixed_tree(self, row: StepRow, drafts: bool, budget: int) -> StepRow:
        request, spec = row.request, row.request.speculation
        proposed = request.drafts.propose(spec.k, self.max_depth(request, spec.w)) if drafts else []
        tree = build_tree(
            request.drafts.history.last_token, proposed, max_nodes=1 + min(spec.k * spec.w, budget)
        )
        return row.with_tree(tree, *((spec.k, spec.w) if spec.mode == "fixed" else (0, 0)))

    def _auto_tree(self, row: StepRow, choice: RowTree, plan: TreePlan) -> StepRow:
        """An auto row with the tree the plan chose for it (its drafts told what was taken)."""
        row.request.drafts.chosen(choice.drafts)
        forecast = choice.expected_tokens / (plan.seconds * self.calibration.level.factor())
        return row.with_tree(
            build_tree(row.request.drafts.history.last_token, choice.drafts),
            choice.k,
            choice.w,
            forecast,
        )

    def plan(
        self,
        auto: Sequence[StepRow],
        rows: Sequence[StepRow],
        budget: int,
        drafted: Collection[StepRow],
        pricing: Pricing | None,
    ) -> TreePlan:
        """The controller's trees for the auto rows; rows not in `drafted` are priced as plain
        rows. `pricing`: the pass's, when taken already this step and still right."""
        shapes = self.calibration
        cost, fixed, prefill_seconds = pricing or self.pricing(rows, set(auto))
        fixed_expected = sum(1 for r in rows if r.tree is not None)
        if not any(row in drafted for row in auto):
            return self._plain(auto, cost, fixed, fixed_expected)
        candidates, may_probe = [], shapes.may_probe
        began = time.perf_counter()
        for row in auto:
            request, spec = row.request, row.request.speculation
            w = self.max_depth(request, spec.w)
            candidates.append(
                RowCandidates(
                    request.drafts.candidates(spec.k, w) if row in drafted else [],
                    spec.k,
                    w,
                    probe=request.calibration.due_for_probe and may_probe,
                    width=row.width + 1,
                )
            )
        shapes.host.observe(time.perf_counter() - began, sum(1 for row in auto if row in drafted))
        if shapes.plain_is_stale(fixed.tokens, len(rows)) and shapes.level.rounds > 0:
            budget = 0  # a plain probe: keeps the relative cost of speculating measured
        plan = plan_trees(
            candidates,
            cost,
            fixed,
            fixed_expected,
            budget,
            prefill_seconds=prefill_seconds,
            row_host_seconds=shapes.host.row_seconds,
        )
        shapes.count_pass(plan.probed)
        return plan

    def _plain(
        self,
        auto: Sequence[StepRow],
        cost: Callable[[PassShape], float],
        fixed: PassShape,
        fixed_expected: int,
    ) -> TreePlan:
        """The plan of a step where no auto row drafted (a quiet step): every auto row its root
        alone, priced as the plain pass, as `plan_trees` would choose, without the search's
        host work around it (the rows' candidates, the probe and host clocks), which right
        after a pass is several times dearer than plain decoding's whole step planning."""
        self.calibration.count_pass(False)
        return TreePlan([PLAIN] * len(auto), fixed.tokens, fixed_expected + len(auto), cost(fixed))

    def pricing(self, rows: Sequence[StepRow], roots: Collection[StepRow]) -> Pricing:
        """The controller's price of a pass shape, the pass's shape as it stands (the rows in
        `roots` counted with the root their tree still lacks) and what its prompt chunks cost
        of it (a row's last chunk, which carries its first tree, included)."""
        shapes = self.calibration
        fixed = pass_shape([row.width + (row in roots) for row in rows])
        context = sum(r.request.context_length for r in rows) / len(rows)

        def pricing(num_rows: int) -> Callable[[PassShape], float]:
            seconds, factor = (
                self.pass_cost(context, num_rows).seconds,
                shapes.size_factor(num_rows),
            )
            return lambda shape: seconds(shape) * factor(shape.tokens)

        cost = pricing(len(rows))
        prefill_seconds = 0.0
        if any(row.chunk for row in rows):  # what the pass would cost without its prompt chunks
            decode_widths = [
                row.width - len(row.chunk) + (row in roots)
                for row in rows
                if row.tree is not None or row in roots
            ]
            decode_only = pricing(len(decode_widths))(pass_shape(decode_widths))
            prefill_seconds = max(cost(fixed) - decode_only, 0.0)
        return cost, fixed, prefill_seconds

    # -- what happened --------------------------------------------------------------------

    def observe_pass(self, widths: Sequence[int], context: float, seconds: float) -> None:
        """A pass's measured time, against what the profile priced it at."""
        if self.profile is not None:
            shape = pass_shape(widths)
            profiled = self.pass_cost(context, len(widths)).seconds(shape)
            self.calibration.observe_pass(shape.tokens, profiled, seconds, len(widths))

    def pass_cost(self, context: float, rows: int) -> PassCost:
        """The profile at a mean context and row count (`CostProfile.at`), the last answer
        kept: a pass's observed time is priced at the context its rows reach, which in a steady
        batch is where the next step's pricing stands."""
        assert self.profile is not None
        last = self._last_cost
        if last is None or last[0] != context or last[1] != rows or last[2] is not self.profile:
            last = self._last_cost = (context, rows, self.profile, self.profile.at(context, rows))
        return last[3]
