"""The speculation policy of each step: which rows draft, and the controller's trees for the
auto rows, priced by the cost profile as the calibration corrects it.

The engine hands over its rows (`PassRow`: a running request's part of the pass) and gets
back the auto rows' trees; it never decides how much to speculate itself. Fixed-mode rows
draft their configured shape, auto-mode rows the trees that buy the most tokens per second
(`planner.plan_trees`), plain rows none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from drafting import RequestDrafts
from service.controller.calibration import Calibration, RequestCalibration
from service.controller.cost_profile import CostProfile, PassCost, PassShape
from service.controller.planner import PLAIN, RowCandidates, RowTree, TreePlan, best_draft_pays, plan_trees
from service.model.tree import TokenTree, build_tree

# The controller's price of a pass shape, the pass's shape as it stands, its prompt chunks' part
Pricing = tuple[Callable[[PassShape], float], PassShape, float]


class Speculation(Protocol):
    """A request's speculation parameters (`service.engine.params.SpeculationParams`)."""

    @property
    def k(self) -> int: ...
    @property
    def w(self) -> int: ...
    @property
    def mode(self) -> str: ...


class PassRequest(Protocol):
    """What the policy reads of a running request (`service.engine.request.Request`)."""

    drafts: RequestDrafts
    calibration: RequestCalibration

    @property
    def speculation(self) -> Speculation: ...
    @property
    def context_length(self) -> int: ...
    @property
    def token_budget(self) -> int: ...


class PassRow(Protocol):
    """A running request's part of a pass: its prompt chunk, then its tree (set here for auto
    rows, with the forecast `choice` the tree came from)."""

    request: PassRequest
    chunk: list[int]
    tree: TokenTree | None
    choice: RowTree | None

    @property
    def width(self) -> int: ...


def pass_shape(widths: Sequence[int]) -> PassShape:
    """A pass whose rows bring `widths` tokens each, as the cost profile prices it."""
    return PassShape(sum(widths), sum(1 for w in widths if w > 1))


class SpeculationPolicy:
    """Decides, every step, which rows draft and the trees of the auto rows."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self.profile: CostProfile | None = None  # set once measured; auto mode needs it
        self.calibration = Calibration()  # how far auto mode's forecasts fall from what happens
        self._last_cost: tuple[float, int, CostProfile, PassCost] | None = None  # `pass_cost`'s last answer

    # -- who drafts -----------------------------------------------------------------------

    def is_auto(self, request: PassRequest) -> bool:
        """The controller chooses this request's trees (auto mode, once the profile exists)."""
        spec = request.speculation
        return spec.mode == "auto" and spec.k > 0 and self.profile is not None

    def drafts_this_step(self, request: PassRequest) -> bool:
        """Whether the request drafts this step: fixed mode while a draft fits its budget; auto
        mode unless it has been plain for a while and this is not one of its drafting rounds
        (`RequestCalibration.drafts_this_round`)."""
        spec = request.speculation
        if self.is_auto(request):
            return request.calibration.drafts_this_round
        return spec.mode == "fixed" and spec.k > 0 and self.max_depth(request, spec.w) > 0

    def drafts_next_round(self, row: PassRow) -> bool:
        """Whether the row's request will be drafted next round (as far as this round tells):
        fixed mode always, auto mode as its calibration says after this round's choice."""
        spec = row.request.speculation
        if self.is_auto(row.request):
            speculates = row.tree is not None and row.tree.num_nodes > 1
            return row.request.calibration.drafts_next_round(speculates)
        return spec.mode == "fixed" and spec.k > 0

    def max_depth(self, request: PassRequest, w: int) -> int:
        """The deepest tree worth building for `request`: a round commits at most depth + 1
        tokens, so nodes past its remaining budget would be discarded, and node d sits at
        position context_length - 1 + d, which must stay inside the model's context."""
        return max(min(w, request.token_budget - 1, self.max_context - request.context_length), 0)

    def gate(self, rows: Sequence[PassRow], decoding: Sequence[PassRow], budget: int
             ) -> tuple[list[PassRow], Pricing | None]:
        """The decoding rows that draft this step, and the pass's pricing when auto rows asked
        for it (taken before any row drafts, so every decoding row counts as its root).

        An auto row drafts only where the best draft known so far (the mixer's best estimate
        over all requests, `Mixer.best_acceptance`), in the auto row cheapest to grow, would
        beat plain decoding in this pass (`planner.best_draft_pays`) — but for one row due for
        a probe when the probe gate is open (a probe re-measures what the forecast believes,
        the pass's costs and the drafts' acceptance included)."""
        speculating = [row for row in decoding if self.drafts_this_step(row.request)]
        drafting = [row for row in speculating if self.is_auto(row.request)]
        if not drafting:
            return speculating, None
        pricing = self.pricing(rows, {id(row) for row in decoding})
        cost, fixed, prefill_seconds = pricing
        depth = max(self.max_depth(row.request, row.request.speculation.w) for row in drafting)
        best = drafting[0].request.drafts.mixer.best_acceptance(depth)  # one mixer per engine
        if budget > 0 and best_draft_pays(cost, fixed, len(decoding), max(row.width + 1 for row in drafting), depth,
                                          prefill_seconds, self.calibration.host.row_seconds, best):
            return speculating, pricing
        prober = next((row for row in drafting if row.request.calibration.due_for_probe and self.calibration.may_probe),
                      None)
        return [row for row in speculating if not self.is_auto(row.request) or row is prober], pricing

    # -- the auto rows' trees -------------------------------------------------------------

    def plan(self, auto: Sequence[PassRow], rows: Sequence[PassRow], budget: int, drafted: set[int],
             pricing: Pricing | None) -> TreePlan:
        """The controller's trees for the auto rows, set on each row; rows not drafted this
        step (`drafted` holds the ids of those that are) are priced as plain rows.
        `pricing`: the pass's, when taken already this step and still right."""
        shapes = self.calibration
        cost, fixed, prefill_seconds = pricing or self.pricing(rows, {id(row) for row in auto})
        fixed_expected = sum(1 for r in rows if r.tree is not None)
        if not any(id(row) in drafted for row in auto):
            return self._plain(auto, cost, fixed, fixed_expected)
        candidates, may_probe = [], shapes.may_probe
        began = time.perf_counter()
        for row in auto:
            request, spec = row.request, row.request.speculation
            w = self.max_depth(request, spec.w)
            candidates.append(RowCandidates(
                request.drafts.candidates(spec.k, w) if id(row) in drafted else [], spec.k, w,
                probe=request.calibration.due_for_probe and may_probe,
                width=row.width + 1,
            ))
        shapes.host.observe(time.perf_counter() - began, sum(1 for row in auto if id(row) in drafted))
        if shapes.plain_is_stale(fixed.tokens, len(rows)) and shapes.level.rounds > 0:
            budget = 0  # a plain probe: keeps the relative cost of speculating measured
        plan = plan_trees(candidates, cost, fixed, fixed_expected, budget, prefill_seconds=prefill_seconds,
                          row_host_seconds=shapes.host.row_seconds)
        self._take(auto, plan)
        return plan

    def _plain(self, auto: Sequence[PassRow], cost: Callable[[PassShape], float], fixed: PassShape,
               fixed_expected: int) -> TreePlan:
        """The plan of a step where no auto row drafted (a quiet step: half to two thirds of a
        lone request's on the 2-core CPU): every auto row its root alone, priced as the plain
        pass, as `plan_trees` would choose, without the search's host work around it (the rows'
        candidates, the probe and host clocks). Right after a pass has streamed the weights
        through the caches, such host work costs several times what it does warm: a quiet
        step's planning took 0.11 ms through the search and takes 0.08 this way, where plain
        decoding's takes 0.025 (medians of ~600 steps, embedded model, one request, dev CPU)."""
        plan = TreePlan([PLAIN] * len(auto), fixed.tokens, fixed_expected + len(auto), cost(fixed))
        self._take(auto, plan)
        return plan

    def _take(self, auto: Sequence[PassRow], plan: TreePlan) -> None:
        """The plan's trees set on the auto rows, and what was taken told to their drafts."""
        self.calibration.count_pass(plan.probed)
        for row, choice in zip(auto, plan.trees):
            row.request.drafts.chosen(choice.drafts)
            row.choice = choice
            row.tree = build_tree(row.request.drafts.history.last_token, choice.drafts)

    def pricing(self, rows: Sequence[PassRow], roots: set[int]) -> Pricing:
        """The controller's price of a pass shape, the pass's shape as it stands (the rows in
        `roots`, by id, counted with the root their tree still lacks) and what its prompt
        chunks cost of it (a row's last chunk, which carries its first tree, included)."""
        shapes = self.calibration
        fixed = pass_shape([row.width + (id(row) in roots) for row in rows])
        context = sum(r.request.context_length for r in rows) / len(rows)

        def pricing(num_rows: int) -> Callable[[PassShape], float]:
            seconds, factor = self.pass_cost(context, num_rows).seconds, shapes.size_factor(num_rows)
            return lambda shape: seconds(shape) * factor(shape.tokens)

        cost = pricing(len(rows))
        prefill_seconds = 0.0
        if any(row.chunk for row in rows):  # what the pass would cost without its prompt chunks
            decode_widths = [row.width - len(row.chunk) + (id(row) in roots)
                             for row in rows if row.tree is not None or id(row) in roots]
            decode_only = pricing(len(decode_widths))(pass_shape(decode_widths))
            prefill_seconds = max(cost(fixed) - decode_only, 0.0)
        return cost, fixed, prefill_seconds

    # -- what happened --------------------------------------------------------------------

    def forecast(self, row: PassRow, plan: TreePlan | None) -> float | None:
        """The tokens per second the controller expected of an auto row's round."""
        if plan is None or row.choice is None:
            return None
        return row.choice.expected_tokens / (plan.seconds * self.calibration.level.factor())

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
