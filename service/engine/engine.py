"""The engine: every step, ONE forward pass over every running request.

    step():  admit → plan the pass (prefill chunks, decode rows) → drafts and trees for every
             decoding request (the controller chooses them jointly) → one flat pass → verify
             each row → commit each row's KV → a `RoundOutput` per request that decoded

State convention (one everywhere): a request's KV row holds every committed token but the
newest; that newest ("pending") token is the root of its next tree. A plain decode step is
the one-node tree, so k = 0 runs through exactly the same code as speculation, and the last
chunk of a prompt carries the request's first tree in the same row.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from drafting import Mixer, PassDistributions, TokenHistory
from service.controller.calibration import Calibration
from service.engine.params import GenerationParams
from service.model_drafts.draft_model import ModelDrafter
from service.engine.logprobs import TokenLogprob, token_logprobs
from service.model.runner import ModelRunner, RowInput
from service.controller.planner import CostProfile, PassShape, RowCandidates, RowTree, TreePlan, plan_trees, sure_draft_pays
from service.engine.request import Request, Status, kv_tokens_needed
from service.engine.sampling import PositionUniforms, greedy_choices_of_rows, top_token_ids_of_rows
from service.engine.scheduler import Scheduler, SchedulerConfig
from service.model.tree import TokenTree, build_tree, chain_tree, prepend_chain
from service.engine.verifier import verify

log = logging.getLogger(__name__)
T = TypeVar("T")
# The controller's price of a pass shape, the pass's shape as it stands, its prompt chunks' part
Pricing = tuple[Callable[[PassShape], float], PassShape, float]


@dataclass(slots=True)
class RoundOutput:
    """The tokens one round committed for one request, and what it cost. Filled in place by
    the step that makes it (its timings once every row is verified: a copy a row cost ~3.5 us,
    0.1-0.2 ms of a 64-row step), read-only once returned."""

    token_ids: list[int]  # committed by this round, truncated at a stop or at max_new_tokens
    num_draft_tokens: int  # drafted tree nodes (root excluded)
    num_accepted_tokens: int  # drafted tokens the model agreed with
    accepted_strategies: list[str]  # strategy of each accepted token, in order
    drafted_by_strategy: dict[str, int]  # tree nodes each strategy put in the tree
    draft_seconds: float  # drafting, planning and learning (scoring, tables) of the whole step
    forward_seconds: float  # the step's pass and verification (shared by its batch)
    finish_reason: str | None  # "stop" | "length" | None while generating
    k: int = 0  # the speculation shape this round used
    w: int = 0
    predicted_tokens_per_second: float | None = None  # the controller's forecast (auto mode)
    batch_size: int = 1  # requests in the pass
    logprobs: list[TokenLogprob] | None = None  # one per token in `token_ids`, when asked for

    @property
    def realized_tokens_per_second(self) -> float:
        return len(self.token_ids) / (self.draft_seconds + self.forward_seconds)


@dataclass(frozen=True)
class StepStats:
    """One pass, for metrics: its batch and its size."""

    batch_size: int  # running requests in the pass
    tokens: int  # tokens in the pass (prefill chunks, roots, tree nodes)
    prefill_tokens: int
    committed_tokens: int  # tokens all requests committed
    seconds: float
    draft_seconds: float  # of `seconds`: planning, drafting and learning (what plain decoding does not do)
    capture_seconds: float = 0.0  # of `pass_seconds`: recording CUDA graphs of new pass shapes (once per shape)
    # of `seconds`: the forward call (on a GPU it returns once the device has run the pass: the
    # logits are gathered by an index from the host, a copy that waits); the rest, `seconds -
    # draft_seconds - pass_seconds`, is verification and the KV commit
    pass_seconds: float = 0.0


@dataclass
class Completion:
    """A whole generation, gathered from its rounds."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # empty unless asked for
    finish_reason: str | None = None
    num_passes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_strategy: Counter[str] = field(default_factory=Counter)
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    seconds: float = 0.0
    predicted_seconds: float = 0.0  # Σ over auto rounds of tokens / forecast tokens per second

    def add(self, round_output: RoundOutput) -> None:
        self.token_ids.extend(round_output.token_ids)
        self.logprobs.extend(round_output.logprobs or [])
        self.finish_reason = round_output.finish_reason
        self.num_passes += 1
        self.num_draft_tokens += round_output.num_draft_tokens
        self.num_accepted_tokens += round_output.num_accepted_tokens
        self.accepted_by_strategy.update(round_output.accepted_strategies)
        self.draft_seconds += round_output.draft_seconds
        self.forward_seconds += round_output.forward_seconds
        if round_output.predicted_tokens_per_second:
            self.predicted_seconds += len(round_output.token_ids) / round_output.predicted_tokens_per_second

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / self.num_passes if self.num_passes else 0.0


class ContextTooLong(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


@dataclass(eq=False)
class _Row:
    """One running request's part of a pass."""

    request: Request
    chunk: list[int]  # prompt tokens this pass puts in the cache
    tree: TokenTree | None = None  # the speculation tree (None: prefill only)
    choice: RowTree | None = None  # the controller's forecast (auto mode)

    @property
    def width(self) -> int:
        """Tokens the row brings to the pass."""
        return len(self.chunk) + (self.tree.num_nodes if self.tree else 0)

    def input(self) -> RowInput:
        if self.tree is None:
            return RowInput(chain_tree(self.chunk), logits_from=len(self.chunk))
        return RowInput(prepend_chain(self.chunk, self.tree), logits_from=len(self.chunk))


class Engine:
    """Runs every admitted request in one batch over a `ModelRunner` and a draft `Mixer`."""

    def __init__(
        self, runner: ModelRunner, mixer: Mixer, eos_token_ids: Sequence[int], max_context: int,
        scheduler_config: SchedulerConfig = SchedulerConfig(),
    ) -> None:
        self.runner = runner
        self.mixer = mixer
        self.profile: CostProfile | None = None  # set once measured; auto mode needs it
        self.calibration = Calibration()  # how far auto mode's forecasts fall from what happens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.cache = runner.new_cache()
        # the draft models' rows count against the KV budget too (an upper bound: all of them per request)
        self.scheduler = Scheduler(scheduler_config.for_device(runner.device.type), self.cache,
                                   runner.kv_bytes_per_token + mixer.kv_bytes_per_token)
        self._ids = itertools.count()
        # this step's learning in the drafting layer: scoring the candidates against the
        # committed tokens, the hand-over of distributions
        self._learn_seconds = 0.0

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: GenerationParams, request_id: str | None = None) -> Request:
        """Queue a request (raises `ContextTooLong` or `DoesNotFit` if it can never run)."""
        if not prompt_ids:
            raise ValueError("the prompt holds no tokens")
        self.check_fits(len(prompt_ids), params)
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            drafts=self.mixer.session(prompt_ids, params.strategy),
            calibration=self.calibration.session(),
            uniforms=None if params.sampling.greedy else PositionUniforms(params.sampling.seed),
            stop_ids=self.eos_token_ids | params.stop_token_ids,
        )
        self.scheduler.add(request)
        return request

    def check_fits(self, num_prompt_tokens: int, params: GenerationParams) -> None:
        """Raise `ContextTooLong` unless prompt + max_new_tokens fits the model's context, or
        `DoesNotFit` if the request alone would exceed the KV memory budget (thread-safe: it
        only reads settings)."""
        max_new_tokens = params.max_new_tokens
        if num_prompt_tokens + max_new_tokens > self.max_context:
            raise ContextTooLong(
                f"this model's context is {self.max_context} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens asks for {max_new_tokens} more "
                f"(at most {max(self.max_context - num_prompt_tokens, 0)} fit)"
            )
        self.scheduler.check_fits(kv_tokens_needed(num_prompt_tokens, params))

    def abort(self, request: Request) -> None:
        """Stop a request; it leaves the batch (or the queue) at the next step."""
        request.aborted = True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step -------------------------------------------------------------------------

    def step(self) -> tuple[list[tuple[Request, RoundOutput | Exception]], StepStats | None]:
        """One pass over every running request; returns each decoding request's round (or the
        error that ended it) and the pass's statistics (None when nothing ran)."""
        self._drop_aborted()
        self.scheduler.admit()
        if not self.scheduler.running:
            return [], None
        started = time.perf_counter()
        rows, plan = self._plan()
        drafted, captured = time.perf_counter(), self.runner.capture_seconds
        try:
            logits = self.runner.forward(self.cache, [row.input() for row in rows])
            passed = time.perf_counter()
        except Exception as error:  # the pass failed: its requests end, the engine goes on
            log.exception("a forward pass failed; ending the %d requests in it", len(rows))
            for row in rows:
                self._finish(row.request, "error")
            return [(row.request, error) for row in rows], None
        self._learn_seconds = 0.0
        top_ids = self._top_ids(rows, logits)
        commits: dict[int, list[int]] = {}  # KV row -> pass entries kept, committed together
        verdicts = [(row, self._verify(row, *row_outputs, commits))
                    for row, *row_outputs in zip(rows, logits, top_ids, self._greedy_choices(rows, logits))]
        self.cache.commit_rows(commits)
        verified = time.perf_counter()
        learned = self._learn_seconds  # drafting work, though it runs after the pass
        draft_seconds, forward_seconds = drafted - started + learned, verified - drafted - learned
        results = [(row.request, self._stamp(out, row, plan, draft_seconds, forward_seconds, len(rows)))
                   for row, out in verdicts if out is not None]
        stats = StepStats(
            batch_size=len(rows), tokens=sum(row.width for row in rows),
            prefill_tokens=sum(len(row.chunk) for row in rows),
            committed_tokens=sum(len(out.token_ids) for _, out in results if isinstance(out, RoundOutput)),
            seconds=verified - started, draft_seconds=draft_seconds,
            capture_seconds=self.runner.capture_seconds - captured, pass_seconds=passed - drafted,
        )
        if not stats.capture_seconds:  # recording a new shape's graph is a one-off, not the shape's price
            self._observe_pass(_pass_shape([row.width for row in rows]), len(rows), verified - drafted)
        for request, out in results:
            if isinstance(out, Exception) or out.finish_reason is not None:
                self._release(request)
        return results, stats

    def _top_ids(self, rows: list[_Row], logits: list[torch.Tensor]) -> list[np.ndarray | None]:
        """Per decoding row, the top-K next tokens at each tree node ([num_nodes, K]), for
        the strategies that learn from every distribution. Only rows whose request drafts next
        round from a successor table take them (`_drafts_next_round`,
        `DraftSession.learns_from_passes`): plain decoding should not pay for drafting
        (the topk alone cost 0.7 ms of a 24-40 ms CPU step, embedded model), nor should an
        auto request's quiet rounds (at C=16 on the 2-core CPU, top tokens and the tables'
        refresh for every auto row took ~0.7 ms a step, for drafts the controller never took);
        the logit hints describe the next round's position, so a row that drafts after a
        skipped round just has none. Row by row, since each row's logits are
        already a contiguous view: gathering them into one tensor first cost more than the
        per-row calls (auto steps of one and sixteen requests, embedded model, 2-core Xeon VM:
        0.31 -> 0.14 ms and 1.11 -> 0.77 ms)."""
        top_k = self.mixer.distribution_top_k
        if top_k == 0:
            return [None] * len(rows)
        started = time.perf_counter()
        wanted = [i for i, row in enumerate(rows)
                  if row.tree is not None and row.request.drafts.learns_from_passes and self._drafts_next_round(row)]
        out = _scattered(len(rows), wanted, top_token_ids_of_rows([logits[i] for i in wanted], top_k))
        self._learn_seconds += time.perf_counter() - started
        return out

    @staticmethod
    def _greedy_choices(rows: list[_Row], logits: list[torch.Tensor]) -> list[list[int] | None]:
        """Each greedy decoding row's argmax token at each of its tree's nodes, every row's taken
        together (off the CPU one device call for the pass, not one a row)."""
        wanted = [i for i, row in enumerate(rows) if row.tree is not None and row.request.params.sampling.greedy]
        return _scattered(len(rows), wanted,
                          greedy_choices_of_rows([logits[i][: rows[i].tree.num_nodes] for i in wanted]))  # type: ignore[union-attr]

    def _plan(self) -> tuple[list[_Row], TreePlan | None]:
        """Each running request's chunk and tree; auto rows chosen jointly by the controller."""
        step_plan = self.scheduler.plan()
        rows = []
        for request in self.scheduler.running:
            chunk = step_plan.prefill_tokens.get(request, 0)
            ids = request.prompt_ids[request.num_cached : request.num_cached + chunk]
            rows.append(_Row(request, ids))
        decoding = [row for row in rows if row.request.prefill_remaining == len(row.chunk)]
        auto = [row for row in decoding if self._is_auto(row.request)]
        is_auto = {id(row) for row in auto}
        speculating = [row for row in decoding if self._drafts_this_step(row.request)]
        speculating, pricing = self._gate_auto_drafts(rows, decoding, is_auto, speculating, step_plan.tree_budget)
        for strategy in self.mixer.batched.values():  # a self-draft drafts in this engine's KV rows
            if isinstance(strategy, ModelDrafter):
                strategy.bind_target(self.cache, self._row_of)
        self.mixer.prepare([(row.request.drafts, row.request.params.speculation.k,
                             self._max_depth(row.request, row.request.params.speculation.w)) for row in speculating])
        budget = step_plan.tree_budget
        for row in decoding:
            spec = row.request.params.speculation
            if id(row) in is_auto:
                continue  # the controller chooses its tree below
            drafts = row.request.drafts.propose(spec.k, self._max_depth(row.request, spec.w)) if row in speculating else []
            row.tree = build_tree(row.request.drafts.history.last_token, drafts, max_nodes=1 + min(spec.k * spec.w, budget))
            budget -= row.tree.num_nodes - 1
        if budget < step_plan.tree_budget:  # fixed-mode trees grew the pass: price it again
            pricing = None
        plan = self._plan_auto(auto, rows, budget, {id(row) for row in speculating}, pricing) if auto else None
        return rows, plan

    def _plan_auto(self, auto: list[_Row], rows: list[_Row], budget: int, drafted: set[int],
                   pricing: Pricing | None) -> TreePlan:
        """The controller's trees for the auto rows; rows not drafted this step (`drafted`
        holds the ids of those that are) are priced as plain rows. `pricing`: the pass's, when
        taken already this step and still right."""
        shapes = self.calibration
        cost, fixed, prefill_seconds = pricing or self._pricing(rows, {id(row) for row in auto})
        candidates, may_probe = [], shapes.may_probe
        began = time.perf_counter()
        for row in auto:
            request, spec = row.request, row.request.params.speculation
            w = self._max_depth(request, spec.w)
            candidates.append(RowCandidates(
                request.drafts.candidates(spec.k, w) if id(row) in drafted else [], spec.k, w,
                probe=request.calibration.due_for_probe and may_probe,
                width=row.width + 1,
            ))
        shapes.host.observe(time.perf_counter() - began, sum(1 for row in auto if id(row) in drafted))
        fixed_expected = sum(1 for r in rows if r.tree is not None)
        if shapes.plain_is_stale(fixed.tokens, len(rows)) and shapes.level.rounds > 0:
            budget = 0  # a plain probe: keeps the relative cost of speculating measured
        plan = plan_trees(candidates, cost, fixed, fixed_expected, budget, prefill_seconds=prefill_seconds,
                          row_host_seconds=shapes.host.row_seconds)
        shapes.count_pass(plan.probed)
        for row, choice in zip(auto, plan.trees):
            row.request.drafts.chosen(choice.drafts)
            row.choice = choice
            row.tree = build_tree(row.request.drafts.history.last_token, choice.drafts)
        return plan

    def _pricing(self, rows: list[_Row], roots: set[int]) -> Pricing:
        """The controller's price of a pass shape, the pass's shape as it stands (the rows in
        `roots`, by id, counted with the root their tree still lacks) and what its prompt
        chunks cost of it (a row's last chunk, which carries its first tree, included)."""
        assert self.profile is not None
        profile, shapes = self.profile, self.calibration
        fixed = _pass_shape([row.width + (id(row) in roots) for row in rows])
        context = sum(r.request.context_length for r in rows) / len(rows)

        def pricing(num_rows: int) -> Callable[[PassShape], float]:
            seconds, factor = profile.at(context, num_rows).seconds, shapes.size_factor(num_rows)
            return lambda shape: seconds(shape) * factor(shape.tokens)

        cost = pricing(len(rows))
        prefill_seconds = 0.0
        if any(row.chunk for row in rows):  # what the pass would cost without its prompt chunks
            decode_widths = [row.width - len(row.chunk) + (id(row) in roots)
                             for row in rows if row.tree is not None or id(row) in roots]
            decode_only = pricing(len(decode_widths))(_pass_shape(decode_widths))
            prefill_seconds = max(cost(fixed) - decode_only, 0.0)
        return cost, fixed, prefill_seconds

    def _gate_auto_drafts(self, rows: list[_Row], decoding: list[_Row], is_auto: set[int], speculating: list[_Row],
                          budget: int) -> tuple[list[_Row], Pricing | None]:
        """`speculating` less its auto rows (ids in `is_auto`) where not even a draft sure to be
        accepted, in the auto row cheapest to grow of those due to draft, would beat plain
        decoding in this pass (`regime.sure_draft_pays`) — but for one row due for a probe when
        the engine's probe gate is open (a probe re-measures what the forecast believes, the
        pass's costs included); and the pass's pricing, taken before any row drafts, so
        fixed-mode rows count as their roots (None: no auto row was due to draft)."""
        drafting = [row for row in speculating if id(row) in is_auto]
        if not drafting:
            return speculating, None
        pricing = self._pricing(rows, {id(row) for row in decoding})
        cost, fixed, prefill_seconds = pricing
        depth = max(self._max_depth(row.request, row.request.params.speculation.w) for row in drafting)
        if budget > 0 and sure_draft_pays(cost, fixed, len(decoding), max(row.width + 1 for row in drafting), depth,
                                          prefill_seconds, self.calibration.host.row_seconds):
            return speculating, pricing
        prober = next((row for row in drafting if row.request.calibration.due_for_probe and self.calibration.may_probe),
                      None)
        return [row for row in speculating if id(row) not in is_auto or row is prober], pricing

    def _row_of(self, history: TokenHistory) -> int:
        """The KV row of the running request whose history this is."""
        row = next(r.row for r in self.scheduler.running if r.drafts.history is history)
        assert row is not None
        return row

    def _is_auto(self, request: Request) -> bool:
        """The controller chooses this request's trees (auto mode, once the profile exists)."""
        spec = request.params.speculation
        return spec.mode == "auto" and spec.k > 0 and self.profile is not None

    def _drafts_this_step(self, request: Request) -> bool:
        """Whether the request drafts this step: fixed mode while a draft fits its budget; auto
        mode unless it has been plain for a while and this is not one of its drafting rounds
        (`RequestCalibration.drafts_this_round`)."""
        spec = request.params.speculation
        if self._is_auto(request):
            return request.calibration.drafts_this_round
        return spec.mode == "fixed" and spec.k > 0 and self._max_depth(request, spec.w) > 0

    def _drafts_next_round(self, row: _Row) -> bool:
        """Whether the row's request will be drafted next round (as far as this round tells):
        fixed mode always, auto mode as its calibration says after this round's choice."""
        spec = row.request.params.speculation
        if self._is_auto(row.request):
            speculates = row.tree is not None and row.tree.num_nodes > 1
            return row.request.calibration.drafts_next_round(speculates)
        return spec.mode == "fixed" and spec.k > 0

    def _max_depth(self, request: Request, w: int) -> int:
        """The deepest tree worth building for `request`: a round commits at most depth + 1
        tokens, so nodes past its remaining budget would be discarded, and node d sits at
        position context_length - 1 + d, which must stay inside the model's context."""
        return max(min(w, request.token_budget - 1, self.max_context - request.context_length), 0)

    def _verify(self, row: _Row, logits, top_ids: np.ndarray | None, greedy: list[int] | None,
                commits: dict[int, list[int]]) -> RoundOutput | Exception | None:
        """Verify a decoding row and commit its tokens, or a prefill chunk; the pass entries
        its KV row keeps go into `commits`."""
        request = row.request
        try:
            if row.tree is None:
                commits[request.row] = list(range(len(row.chunk)))  # type: ignore[index]
                request.num_cached += len(row.chunk)
                return None
            request.num_cached += len(row.chunk)
            verdict = verify(row.tree, logits, request.params.sampling, request.uniforms,
                             first_position=request.context_length, greedy=greedy)
            offset = len(row.chunk)
            kept = [*range(offset), offset, *(offset + node for node in verdict.accepted_nodes)]
            commits[request.row] = kept  # type: ignore[index]
            if row.choice is not None:
                request.calibration.observe_round(row.tree.num_nodes > 1)
            history = request.drafts.history
            root_parent = history.token_ids[-2] if len(history) > 1 else -1  # before this round's tokens join
            started = time.perf_counter()
            request.drafts.observe(verdict.token_ids)
            if top_ids is not None:
                stop_node = verdict.accepted_nodes[-1] if verdict.accepted_nodes else 0
                request.drafts.observe_distributions(_pass_distributions(row.tree, top_ids, stop_node, root_parent))
            self._learn_seconds += time.perf_counter() - started
            token_ids, finish_reason = _truncate(verdict.token_ids, request.stop_ids, request.token_budget)
            request.num_generated += len(token_ids)
            request.finish_reason = finish_reason
            asked = request.params.logprobs
            logprobs = None if asked is None else token_logprobs(
                logits, verdict.choosing_nodes[: len(token_ids)], token_ids, asked)
            return RoundOutput(
                token_ids=token_ids,
                logprobs=logprobs,
                num_draft_tokens=row.tree.num_nodes - 1,
                num_accepted_tokens=len(verdict.accepted_nodes),
                accepted_strategies=[row.tree.strategies[i] or "" for i in verdict.accepted_nodes],
                drafted_by_strategy=dict(Counter(s for s in row.tree.strategies[1:] if s)) if row.tree.num_nodes > 1 else {},
                draft_seconds=0.0, forward_seconds=0.0, finish_reason=finish_reason,
                **_shape_used(row),
            )
        except Exception as error:  # this request fails; the others in the pass go on
            log.exception("request %s failed", request.request_id)
            request.finish_reason = "error"
            return error

    def _stamp(self, out: RoundOutput | Exception, row: _Row, plan: TreePlan | None, draft_seconds: float,
               forward_seconds: float, batch_size: int) -> RoundOutput | Exception:
        """Fill in the step's timings and, in auto mode, the row's forecast."""
        if isinstance(out, Exception):
            return out
        if plan is not None and row.choice is not None:
            out.predicted_tokens_per_second = row.choice.expected_tokens / (plan.seconds * self.calibration.level.factor())
        out.draft_seconds, out.forward_seconds, out.batch_size = draft_seconds, forward_seconds, batch_size
        return out

    def _observe_pass(self, shape: PassShape, rows: int, seconds: float) -> None:
        if self.profile is not None:
            context = sum(r.context_length for r in self.scheduler.running) / max(len(self.scheduler.running), 1)
            profiled = self.profile.at(context, rows).seconds(shape)
            self.calibration.observe_pass(shape.tokens, profiled, seconds, rows)

    def _drop_aborted(self) -> None:
        self.scheduler.drop_aborted_waiting()
        for request in [r for r in self.scheduler.running if r.aborted]:
            self._finish(request, "abort")

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = request.finish_reason or reason
        self._release(request)

    def _release(self, request: Request) -> None:
        request.drafts.close()
        self.scheduler.finish(request)

    # -- offline use (benchmarks, tests): the caller owns the engine ------------------------

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams) -> Iterator[RoundOutput]:
        """Yield one request's rounds until a stop token or `max_new_tokens` (stepping the
        whole engine: for callers that own it, like the benchmark)."""
        request = self.add_request(prompt_ids, params)
        try:
            while request.status is not Status.FINISHED:
                results, _ = self.step()
                for owner, out in results:
                    if owner is request:
                        if isinstance(out, Exception):
                            raise out
                        yield out
        finally:
            if request.status is not Status.FINISHED:
                self.abort(request)
                self._drop_aborted()

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> Completion:
        """Run `generate` to the end and gather the result."""
        return self.complete_many([(prompt_ids, params)])[0]

    def complete_many(self, requests: Sequence[tuple[Sequence[int], GenerationParams]]) -> list[Completion]:
        """Run several requests together in one batch to the end; one `Completion` each."""
        started = time.perf_counter()
        added = [self.add_request(prompt, params) for prompt, params in requests]
        completions = {id(r): Completion() for r in added}
        while any(r.status is not Status.FINISHED for r in added):
            results, _ = self.step()
            for request, out in results:
                if isinstance(out, Exception):
                    raise out
                if id(request) in completions:
                    completions[id(request)].add(out)
                    if out.finish_reason is not None:
                        completions[id(request)].seconds = time.perf_counter() - started
        return [completions[id(r)] for r in added]


def _scattered(size: int, at: list[int], values: Sequence[T]) -> list[T | None]:
    """A list of `size` Nones with `values` placed at the indices `at`."""
    out: list[T | None] = [None] * size
    for index, value in zip(at, values):
        out[index] = value
    return out


def _pass_distributions(tree: TokenTree, top_ids: np.ndarray, stop_node: int, root_parent: int) -> PassDistributions:
    """What a row's pass showed, each node with the token before it (its parent's; the root's
    from the context, -1 where it has none)."""
    tokens = np.asarray(tree.token_ids)
    parent_tokens = tokens[tree.parents]  # the root's parent index, -1, reads the last node: replaced
    parent_tokens[0] = root_parent
    return PassDistributions(tokens, top_ids, stop_node, parent_tokens)


def _pass_shape(widths: Sequence[int]) -> PassShape:
    """A pass whose rows bring `widths` tokens each, as the cost profile prices it."""
    return PassShape(sum(widths), sum(1 for w in widths if w > 1))


def _shape_used(row: _Row) -> dict[str, int]:
    """The round's (k, w): the configured shape in fixed mode, the chosen tree in auto mode."""
    spec = row.request.params.speculation
    if row.choice is not None:
        return {"k": row.choice.k, "w": row.choice.w}
    if spec.mode == "fixed":
        return {"k": spec.k, "w": spec.w}
    return {"k": 0, "w": 0}


def _truncate(token_ids: list[int], stops: frozenset[int], budget: int) -> tuple[list[int], str | None]:
    """Cut a round's tokens after the first stop token, or at the remaining token budget."""
    for i, token in enumerate(token_ids[:budget]):
        if token in stops:
            return token_ids[: i + 1], "stop"
    if len(token_ids) >= budget:
        return token_ids[:budget], "length"
    return token_ids, None
