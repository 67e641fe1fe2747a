"""The engine: every step, ONE forward pass over every running request.

    step():  schedule (admit: cached prefix blocks loaded; prompt chunks) → plan (drafts and a tree for every decoding row;
             the controller's policy chooses the auto rows' jointly) → one flat pass → verify
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from drafting import Mixer, PassDistributions, TokenHistory
from service.controller.calibration import Calibration
from service.controller.cost_profile import CostProfile
from service.controller.planner import RowTree, TreePlan
from service.controller.policy import SpeculationPolicy
from service.engine.logits_adjuster import LogitsAdjuster
from service.engine.logprobs import token_logprobs
from service.engine.outputs import Completion, RoundOutput, StepStats
from service.engine.params import GenerationParams
from service.engine.request import Request, Status, kv_tokens_needed
from service.engine.sampling import PositionUniforms, greedy_choices_of_rows, top_token_ids_of_rows
from service.engine.scheduler import Scheduler, SchedulerConfig
from service.engine.timing import StepTimer
from service.engine.verifier import Verdict, verify
from service.engine.device_steps import device_chooser, device_step_plan
from service.device_round.round import DevicePlan, DeviceRound
from service.grammar import Constraint, ForcedText, GrammarCompiler, GrammarError
from service.model.runner import ModelRunner, RowInput
from service.model.tree import TokenTree, build_tree, chain_tree, prepend_chain
from service.model_drafts.draft_model import ModelDrafter

log = logging.getLogger(__name__)
T = TypeVar("T")


# a step's rounds, each with its request (or the error that ended it), and its pass's statistics
StepResult = tuple[list[tuple[Request, RoundOutput | Exception]], StepStats | None]


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
    """Runs every admitted request in one batch over a `ModelRunner` and a draft `Mixer`;
    how much each row speculates is the `SpeculationPolicy`'s call."""

    def __init__(
        self, runner: ModelRunner, mixer: Mixer, eos_token_ids: Sequence[int], max_context: int,
        scheduler_config: SchedulerConfig = SchedulerConfig(), grammars: GrammarCompiler | None = None,
        device_round: bool | None = None,
    ) -> None:
        """`device_round`: run the steps it can take on the model's device
        (`service/device_round/`); None: where that device is a GPU."""
        self.runner = runner
        self.grammars = grammars  # compiles structured output's grammars (None: the engine has no tokenizer)
        self.mixer = mixer
        self.policy = SpeculationPolicy(max_context)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.cache = runner.new_cache()
        # the draft models' rows count against the KV budget too (an upper bound: all of them per request)
        self.scheduler = Scheduler(scheduler_config.for_device(runner.device.type), self.cache,
                                   runner.kv_bytes_per_token + mixer.kv_bytes_per_token)
        self._ids = itertools.count()
        on_gpu = runner.device.type == "cuda"
        self.device_round = DeviceRound(runner, mixer) if (on_gpu if device_round is None else device_round) else None

    @property
    def profile(self) -> CostProfile | None:
        """The measured pass costs; auto mode speculates once they exist."""
        return self.policy.profile

    @profile.setter
    def profile(self, profile: CostProfile | None) -> None:
        self.policy.profile = self.scheduler.profile = profile

    @property
    def calibration(self) -> Calibration:
        return self.policy.calibration

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: GenerationParams, request_id: str | None = None) -> Request:
        """Queue a request (raises `ContextTooLong` or `DoesNotFit` if it can never run,
        `GrammarError` for a grammar it cannot follow, and `ValueError` for a logit_bias token
        outside the vocabulary)."""
        if not prompt_ids:
            raise ValueError("the prompt holds no tokens")
        self.check_fits(len(prompt_ids), params)
        constraint = self._constraint(params)
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            drafts=self.mixer.for_request(prompt_ids, params.strategy),
            calibration=self.calibration.for_request(),
            uniforms=None if params.sampling.greedy else PositionUniforms(params.sampling.seed),
            stop_ids=self.eos_token_ids | params.stop_token_ids,
            logits_adjuster=LogitsAdjuster.for_request(params.sampling, prompt_ids, self.runner.vocab_size,
                                                       self.runner.device),
            constraint=constraint,
        )
        if constraint is not None:  # drafts are cut where they leave the grammar; its forced text is one
            request.drafts.restrict(constraint.legal_lengths, ForcedText(constraint, self.grammars.encode))  # type: ignore[union-attr]
        self.scheduler.add(request)
        return request

    def _constraint(self, params: GenerationParams) -> Constraint | None:
        """A new matcher of the request's grammar (compiled once per grammar), or None."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise GrammarError("structured output needs the model's tokenizer", params.grammar.field)
        return Constraint(self.grammars.compile(params.grammar), sorted(self.eos_token_ids))

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

    def step(self) -> StepResult:
        """One pass over every running request: schedule → plan → pass → verify → commit →
        outputs (each decoding request's round or error; the pass's statistics, None if idle)."""
        rows, tree_budget = self._schedule()
        if not rows:
            return [], None
        timer = StepTimer()
        device_plan = None if self.device_round is None else device_step_plan(
            self.device_round, self.policy, rows, tree_budget)
        if device_plan is not None:
            return self._device_step(rows, device_plan, timer)
        if self.device_round is not None:
            self.device_round.hand_tables_to_host()
        plan = self._plan(rows, tree_budget)
        logits = self._forward(rows, timer)
        if isinstance(logits, Exception):
            return self._fail(rows, logits), None
        rounds = self._verify(rows, logits, timer)
        return self._outputs(rows, rounds, plan, timer)

    def _schedule(self) -> tuple[list[_Row], int]:
        """Admit what fits; each running request's row with the prompt chunk this pass
        carries, and the tree nodes the pass has room for."""
        self._drop_aborted()
        self.scheduler.admit()
        if not self.scheduler.running:
            return [], 0
        step_plan = self.scheduler.plan()
        rows = []
        for request in self.scheduler.running:
            chunk = step_plan.prefill_tokens.get(request, 0)
            rows.append(_Row(request, request.prompt_ids[request.num_cached : request.num_cached + chunk]))
        return rows, step_plan.tree_budget

    def _device_step(self, rows: list[_Row], plan: DevicePlan, timer: StepTimer) -> StepResult:
        """The step on the device (`DeviceRound.run`): each row's round from the one copy it
        makes back, the rows' histories extended, finished requests leaving the batch."""
        template = plan.template
        timer.mark_drafted(self.runner.capture_seconds)
        try:
            step = self.device_round.run(self.cache, [row.request.drafts.history for row in rows], plan,  # type: ignore[union-attr]
                                         device_chooser([row.request for row in rows], template, self.runner.device))
        except Exception as error:
            return self._fail(rows, error), None
        timer.mark_passed(self.runner.capture_seconds)
        chain_drafted = step.drafted[:, 1 : 1 + template.chain].sum(1).tolist()
        table_drafted = step.drafted[:, 1 + template.chain :].sum(1).tolist()
        table = plan.table or ""
        rounds: list[RoundOutput | Exception | None] = []
        for index, row in enumerate(rows):
            row.tree = template.shape_tree  # the pass's shape (what the statistics count)
            committed = step.token_ids(index)
            row.request.drafts.observe(committed)
            token_ids, finish_reason = _finish_round(row.request, committed)
            accepted = step.accepted_nodes(index)
            drafted = {name: count for name, count in (("context", chain_drafted[index]), (table, table_drafted[index]))
                       if count}
            rounds.append(RoundOutput(
                token_ids=token_ids, logprobs=None, num_draft_tokens=sum(drafted.values()),
                num_accepted_tokens=len(accepted),
                accepted_strategies=["context" if node <= template.chain else table for node in accepted],
                drafted_by_strategy=drafted, draft_seconds=0.0, forward_seconds=0.0, finish_reason=finish_reason,
                **({"k": template.k, "w": template.w} if self.policy.is_auto(row.request) else _shape_used(row)),
            ))
        timer.mark_verified()
        results, stats = self._outputs(rows, rounds, None, timer, wait_seconds=step.wait_seconds, syncs=1)
        for request, out in results:
            if isinstance(out, RoundOutput) and self.policy.is_auto(request):
                out.predicted_tokens_per_second = plan.forecast
        return results, stats

    def _plan(self, rows: list[_Row], budget: int) -> TreePlan | None:
        """Drafts and a tree for every decoding row: the configured shape in fixed mode, the
        controller's joint choice for the auto rows (its plan returned, for the forecasts)."""
        policy = self.policy
        decoding = [row for row in rows if row.request.prefill_remaining == len(row.chunk)]
        speculating, pricing = policy.gate(rows, decoding, budget)
        self._bind_model_drafters()
        self.mixer.prepare([(row.request.drafts, row.request.speculation.k,
                             policy.max_depth(row.request, row.request.speculation.w)) for row in speculating])
        auto = [row for row in decoding if policy.is_auto(row.request)]
        left = self._fixed_trees([row for row in decoding if not policy.is_auto(row.request)], speculating, budget)
        if not auto:
            return None
        # fixed-mode trees that grew the pass make the gate's pricing stale
        return policy.plan(auto, rows, left, {id(row) for row in speculating}, pricing if left == budget else None)

    def _fixed_trees(self, rows: list[_Row], speculating: list[_Row], budget: int) -> int:
        """Trees for the rows the controller does not plan: a fixed-mode row's drafts while the
        pass has room for them, else the root alone. Returns the tree nodes left."""
        for row in rows:
            request, spec = row.request, row.request.speculation
            drafts = request.drafts.propose(spec.k, self.policy.max_depth(request, spec.w)) if row in speculating else []
            row.tree = build_tree(request.drafts.history.last_token, drafts, max_nodes=1 + min(spec.k * spec.w, budget))
            budget -= row.tree.num_nodes - 1
        return budget

    def _bind_model_drafters(self) -> None:
        for strategy in self.mixer.batched.values():  # a self-draft drafts in this engine's KV rows
            if isinstance(strategy, ModelDrafter):
                strategy.bind_target(self.cache, self._row_of)

    def _forward(self, rows: list[_Row], timer: StepTimer) -> list[torch.Tensor] | Exception:
        """The pass over every row: each row's logits from its first tree node on, or the
        error that failed the pass (its requests end; the engine goes on)."""
        timer.mark_drafted(self.runner.capture_seconds)
        try:
            logits = self.runner.forward(self.cache, [row.input() for row in rows])
        except Exception as error:
            return error
        timer.mark_passed(self.runner.capture_seconds)
        return logits

    def _verify(self, rows: list[_Row], logits: list[torch.Tensor], timer: StepTimer) -> list[RoundOutput | Exception | None]:
        """Verify every row against the pass, let its drafts learn, and commit the KV entries
        the rows keep, all rows together. A row's round, its error, or None for a prefill chunk."""
        with timer.learning():
            top_ids = self._top_ids(rows, logits)
        adjusted = [_adjusted(row, row_logits) for row, row_logits in zip(rows, logits)]
        commits: dict[int, list[int]] = {}  # KV row -> pass entries kept
        rounds = [self._verify_row(row, *row_outputs, commits, timer)
                  for row, *row_outputs in zip(rows, logits, adjusted, top_ids, self._greedy_choices(rows, adjusted))]
        self.cache.commit_rows(commits)
        for row in rows:
            if row.chunk:  # a prompt's blocks serve the requests that share them from now on
                self.scheduler.keep_prefix(row.request)
        timer.mark_verified()
        return rounds

    def _verify_row(self, row: _Row, logits: torch.Tensor, adjusted: torch.Tensor, top_ids: np.ndarray | None,
                    greedy: list[int] | None, commits: dict[int, list[int]],
                    timer: StepTimer) -> RoundOutput | Exception | None:
        """A row's prompt chunk joins its cache row; a decoding row's tree is verified (on its
        `adjusted` logits), the pass entries its KV row keeps go into `commits`, and its drafts
        learn the outcome."""
        request = row.request
        request.num_cached += len(row.chunk)
        if row.tree is None:
            commits[request.row] = list(range(len(row.chunk)))  # type: ignore[index]
            return None
        try:
            verdict = verify(row.tree, adjusted, request.params.sampling, request.uniforms,
                             first_position=request.context_length, greedy=greedy,
                             constraint=request.constraint, stop_ids=request.stop_ids)
            offset = len(row.chunk)
            commits[request.row] = [*range(offset), offset, *(offset + node for node in verdict.accepted_nodes)]  # type: ignore[index]
            if row.choice is not None:
                request.calibration.observe_round(row.tree.num_nodes > 1)
            with timer.learning():
                _learn(row.request, row.tree, verdict, top_ids)
            return self._round_output(row, verdict, logits)
        except Exception as error:  # this request fails; the others in the pass go on
            log.exception("request %s failed", request.request_id)
            request.finish_reason = "error"
            return error

    @staticmethod
    def _round_output(row: _Row, verdict: Verdict, logits: torch.Tensor | None) -> RoundOutput:
        """What the round committed, cut after a stop token or at the request's budget, with
        each token's logprobs when asked for (the step's times are stamped on later)."""
        request, tree = row.request, row.tree
        assert tree is not None
        token_ids, finish_reason = _finish_round(request, verdict.token_ids)
        asked = request.params.logprobs
        logprobs = None if asked is None or logits is None else token_logprobs(
            logits, verdict.choosing_nodes[: len(token_ids)], token_ids, asked)
        return RoundOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            num_draft_tokens=tree.num_nodes - 1,
            num_accepted_tokens=len(verdict.accepted_nodes),
            accepted_strategies=[tree.strategies[i] or "" for i in verdict.accepted_nodes],
            drafted_by_strategy=dict(Counter(s for s in tree.strategies[1:] if s)) if tree.num_nodes > 1 else {},
            draft_seconds=0.0, forward_seconds=0.0, finish_reason=finish_reason,
            grammar_seconds=0.0 if request.constraint is None else request.constraint.take_seconds(),
            **_shape_used(row),
        )

    def _outputs(self, rows: list[_Row], rounds: list[RoundOutput | Exception | None], plan: TreePlan | None,
                 timer: StepTimer, wait_seconds: float = 0.0, syncs: int = 0) -> StepResult:
        """Each decoding row's round with the step's times (and, in auto mode, the
        controller's forecast), the pass's statistics; finished requests leave the batch."""
        results = [(row.request, self._stamp(out, row, plan, timer, len(rows)))
                   for row, out in zip(rows, rounds) if out is not None]
        stats = StepStats(
            batch_size=len(rows), tokens=sum(row.width for row in rows),
            prefill_tokens=sum(len(row.chunk) for row in rows),
            committed_tokens=sum(len(out.token_ids) for _, out in results if isinstance(out, RoundOutput)),
            seconds=timer.seconds, draft_seconds=timer.draft_seconds,
            capture_seconds=timer.capture_seconds, pass_seconds=timer.pass_seconds,
            wait_seconds=wait_seconds, syncs=syncs,
        )
        if not stats.capture_seconds:  # recording a new shape's graph is a one-off, not the shape's price
            context = sum(r.context_length for r in self.scheduler.running) / max(len(self.scheduler.running), 1)
            self.policy.observe_pass([row.width for row in rows], context, timer.verified - timer.drafted)
        for request, out in results:
            if isinstance(out, Exception) or out.finish_reason is not None:
                self._release(request)
        return results, stats

    def _stamp(self, out: RoundOutput | Exception, row: _Row, plan: TreePlan | None, timer: StepTimer,
               batch_size: int) -> RoundOutput | Exception:
        """Fill in the step's timings and, in auto mode, the row's forecast."""
        if isinstance(out, Exception):
            return out
        out.predicted_tokens_per_second = self.policy.forecast(row, plan)
        out.draft_seconds, out.forward_seconds, out.batch_size = timer.draft_seconds, timer.forward_seconds, batch_size
        return out

    def _top_ids(self, rows: list[_Row], logits: list[torch.Tensor]) -> list[np.ndarray | None]:
        """Per decoding row, the top-K next tokens at each tree node ([num_nodes, K]), for
        the strategies that learn from every distribution. Only rows whose request drafts next
        round from a successor table take them (`SpeculationPolicy.drafts_next_round`,
        `RequestDrafts.learns_from_passes`): plain decoding should not pay for drafting
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
        wanted = [i for i, row in enumerate(rows) if row.tree is not None and row.request.drafts.learns_from_passes
                  and self.policy.drafts_next_round(row)]
        return _scattered(len(rows), wanted, top_token_ids_of_rows([logits[i] for i in wanted], top_k))

    @staticmethod
    def _greedy_choices(rows: list[_Row], logits: list[torch.Tensor]) -> list[list[int] | None]:
        """Each greedy unconstrained decoding row's argmax token at each of its tree's nodes (of the
        `_adjusted` logits), every row's taken together (off the CPU one device call for the pass, not one a row)."""
        wanted = [i for i, row in enumerate(rows) if row.tree is not None and row.request.params.sampling.greedy
                  and row.request.constraint is None]
        return _scattered(len(rows), wanted,
                          greedy_choices_of_rows([logits[i][: rows[i].tree.num_nodes] for i in wanted]))  # type: ignore[union-attr]

    def _row_of(self, history: TokenHistory) -> int:
        """The KV row of the running request whose history this is."""
        row = next(r.row for r in self.scheduler.running if r.drafts.history is history)
        assert row is not None
        return row

    def _fail(self, rows: list[_Row], error: Exception) -> list[tuple[Request, RoundOutput | Exception]]:
        """A pass that failed ends its requests; the engine goes on with the next step."""
        log.error("a forward pass failed; ending the %d requests in it", len(rows), exc_info=error)
        for row in rows:
            self._finish(row.request, "error")
        return [(row.request, error) for row in rows]

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


def _adjusted(row: _Row, logits: torch.Tensor) -> torch.Tensor:
    """A decoding row's logits after its request's logit_bias and penalties, each node's from
    its own path; the raw logits themselves for every other row. The raw ones stay what the
    successor tables (shared by all requests) learn from and what logprobs report."""
    adjuster = row.request.logits_adjuster
    if row.tree is None or adjuster is None:
        return logits
    return adjuster(logits, row.tree, row.request.drafts.history.token_ids)


def _scattered(size: int, at: list[int], values: Sequence[T]) -> list[T | None]:
    """A list of `size` Nones with `values` placed at the indices `at`."""
    out: list[T | None] = [None] * size
    for index, value in zip(at, values):
        out[index] = value
    return out


def _learn(request: Request, tree: TokenTree, verdict: Verdict, top_ids: np.ndarray | None) -> None:
    """The request's drafts learn what the round committed and, where taken, what the pass's
    distributions showed at each node."""
    history = request.drafts.history
    root_parent = history.token_ids[-2] if len(history) > 1 else -1  # before this round's tokens join
    request.drafts.observe(verdict.token_ids)
    if top_ids is not None:
        stop_node = verdict.accepted_nodes[-1] if verdict.accepted_nodes else 0
        request.drafts.observe_distributions(_pass_distributions(tree, top_ids, stop_node, root_parent))


def _pass_distributions(tree: TokenTree, top_ids: np.ndarray, stop_node: int, root_parent: int) -> PassDistributions:
    """What a row's pass showed, each node with the token before it (its parent's; the root's
    from the context, -1 where it has none)."""
    tokens = np.asarray(tree.token_ids)
    parent_tokens = tokens[tree.parents]  # the root's parent index, -1, reads the last node: replaced
    parent_tokens[0] = root_parent
    return PassDistributions(tokens, top_ids, stop_node, parent_tokens)


def _shape_used(row: _Row) -> dict[str, int]:
    """The round's (k, w): the configured shape in fixed mode, the chosen tree in auto mode."""
    spec = row.request.params.speculation
    if row.choice is not None:
        return {"k": row.choice.k, "w": row.choice.w}
    if spec.mode == "fixed":
        return {"k": spec.k, "w": spec.w}
    return {"k": 0, "w": 0}


def _finish_round(request: Request, committed: list[int]) -> tuple[list[int], str | None]:
    """A round's tokens as the request takes them (`_truncate`), counted, and why it ends if it does."""
    token_ids, finish_reason = _truncate(committed, request.stop_ids, request.token_budget)
    request.num_generated += len(token_ids)
    request.finish_reason = finish_reason
    return token_ids, finish_reason


def _truncate(token_ids: list[int], stops: frozenset[int], budget: int) -> tuple[list[int], str | None]:
    """Cut a round's tokens after the first stop token, or at the remaining token budget."""
    for i, token in enumerate(token_ids[:budget]):
        if token in stops:
            return token_ids[: i + 1], "stop"
    if len(token_ids) >= budget:
        return token_ids[:budget], "length"
    return token_ids, None
