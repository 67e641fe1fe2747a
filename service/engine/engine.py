"""The engine: every step, ONE forward pass over every running request.

    step():  schedule (admit: cached prefix blocks loaded; prompt chunks) → the step's path
             (the policy's trees, the pass, each row verified and its KV committed: on the
             host, or on the device round where it can take the step) → each request's round

State convention (one everywhere): a request's KV row holds every committed token but the
newest; that newest ("pending") token is the root of its next tree. A plain decode step is
the one-node tree, so k = 0 runs through exactly the same code as speculation, and the last
chunk of a prompt carries the request's first tree in the same row.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence

from drafting import Mixer
from service.controller.calibration import Calibration
from service.controller.cost_profile import CostProfile
from service.device_round.round import DeviceRound
from service.engine.device_step import DeviceStep
from service.engine.host_step import HostStep
from service.engine.logits_adjuster import LogitsAdjuster
from service.engine.outputs import Completion, RoundOutput, StepStats
from service.engine.params import GenerationParams
from service.engine.policy import SpeculationPolicy
from service.engine.request import Request, Status, kv_tokens_needed
from service.engine.sampling import PositionUniforms
from service.engine.scheduler import Scheduler, SchedulerConfig
from service.engine.step_row import PassFailed, StepOutput, StepRounds, StepRow
from service.engine.timing import StepTimer
from service.grammar import Constraint, ForcedText, GrammarCompiler, GrammarError
from service.model.runner import ModelRunner

log = logging.getLogger(__name__)


class ContextTooLong(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


class Engine:
    """Runs every admitted request in one batch over a `ModelRunner` and a draft `Mixer`;
    how much each row speculates is the `SpeculationPolicy`'s call."""

    def __init__(
        self,
        runner: ModelRunner,
        mixer: Mixer,
        eos_token_ids: Sequence[int],
        max_context: int,
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        grammars: GrammarCompiler | None = None,
        device_round: bool | None = None,
    ) -> None:
        """`device_round`: run the steps it can take on the model's device
        (`service/device_round/`); None: where that device is a GPU."""
        self.runner = runner
        # compiles structured output's grammars (None: the engine has no tokenizer)
        self.grammars = grammars
        self.mixer = mixer
        self.policy = SpeculationPolicy(max_context)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.cache = runner.new_cache()
        # the draft models' rows count against the KV budget too (an upper bound: all of them per
        # request)
        self.scheduler = Scheduler(
            scheduler_config.for_device(runner.device.type),
            self.cache,
            runner.kv_bytes_per_token + mixer.kv_bytes_per_token,
        )
        self._ids = itertools.count()
        host = HostStep(runner, self.cache, mixer, self.policy, self.scheduler)
        on_gpu = runner.device.type == "cuda"
        self.device_round = (
            DeviceRound(runner, mixer)
            if (on_gpu if device_round is None else device_round)
            else None
        )
        self._path: HostStep | DeviceStep = (
            host
            if self.device_round is None
            else DeviceStep(self.device_round, host, runner, self.policy)
        )  # where every step runs

    @property
    def profile(self) -> CostProfile | None:
        """The measured pass costs; auto mode speculates once they exist."""
        return self.policy.profile

    @profile.setter
    def profile(self, profile: CostProfile | None) -> None:
        self.policy.profile = self.scheduler.profile = profile

    def use_default_profile(self, profile: CostProfile) -> None:
        """Let auto mode price trees with a device class's conservative `profile` until one is
        measured (`service/controller/default_profile.py`). Its level is a guess the
        calibration corrects for the controller only, so the scheduler sizes prefill chunks as
        it does without a profile."""
        self.policy.profile, self.scheduler.profile = profile, None

    @property
    def calibration(self) -> Calibration:
        return self.policy.calibration

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: GenerationParams, request_id: str | None = None
    ) -> Request:
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
            logits_adjuster=LogitsAdjuster.for_request(
                params.sampling, prompt_ids, self.runner.vocab_size, self.runner.device
            ),
            constraint=constraint,
        )
        if (
            constraint is not None
        ):  # drafts are cut where they leave the grammar; its forced text is one
            request.drafts.restrict(
                constraint.legal_lengths, ForcedText(constraint, self.grammars.encode)
            )  # type: ignore[union-attr]
        self.scheduler.add(request)
        return request

    def _constraint(self, params: GenerationParams) -> Constraint | None:
        """A new matcher of the request's grammar, or None. The grammar comes compiled from the
        server's edge (`service/grammar/bounded.py`), which bounds the compile's time and keeps
        it off this thread; a request built in process without it is compiled here."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise GrammarError(
                "structured output needs the model's tokenizer", params.grammar.field
            )
        compiled = params.compiled_grammar or self.grammars.compile(params.grammar)
        return Constraint(compiled, sorted(self.eos_token_ids))

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

    def step(self) -> StepOutput:
        """One pass over every running request: schedule → the step's path → each decoding
        request's round (or error) and the pass's statistics (None if idle)."""
        rows, tree_budget = self._schedule()
        if not rows:
            return StepOutput([], None)
        timer = StepTimer()
        try:
            done = self._path.run(rows, tree_budget, timer)
        except PassFailed as failure:
            return self._fail(rows, failure)
        return self._outputs(done, timer)

    def _schedule(self) -> tuple[list[StepRow], int]:
        """Admit what fits; each running request's row with the prompt chunk this pass
        carries, and the tree nodes the pass has room for."""
        self._drop_aborted()
        self.scheduler.admit()
        if not self.scheduler.running:
            return [], 0
        schedule = self.scheduler.schedule()
        rows = []
        for request in self.scheduler.running:
            chunk = schedule.prefill_tokens.get(request, 0)
            rows.append(
                StepRow(request, request.token_ids[request.num_cached : request.num_cached + chunk])
            )
        return rows, schedule.tree_budget

    def _outputs(self, done: StepRounds, timer: StepTimer) -> StepOutput:
        """Each decoding row's round with the step's times, and the pass's statistics;
        finished requests leave the batch."""
        rows = done.rows
        results: list[tuple[Request, RoundOutput | Exception]] = []
        for row, out in zip(rows, done.rounds):
            if isinstance(out, RoundOutput):
                out.draft_seconds, out.forward_seconds, out.batch_size = (
                    timer.draft_seconds,
                    timer.forward_seconds,
                    len(rows),
                )
            if out is not None:
                results.append((row.request, out))
        stats = StepStats(
            batch_size=len(rows),
            tokens=sum(row.width for row in rows),
            prefill_tokens=sum(len(row.chunk) for row in rows),
            committed_tokens=sum(
                len(out.token_ids) for _, out in results if isinstance(out, RoundOutput)
            ),
            seconds=timer.seconds,
            draft_seconds=timer.draft_seconds,
            capture_seconds=timer.capture_seconds,
            pass_seconds=timer.pass_seconds,
            wait_seconds=done.wait_seconds,
            syncs=done.syncs,
        )
        if (
            not stats.capture_seconds
        ):  # recording a new shape's graph is a one-off, not the shape's price
            context = sum(r.context_length for r in self.scheduler.running) / max(
                len(self.scheduler.running), 1
            )
            self.policy.observe_pass(
                [row.width for row in rows], context, timer.verified - timer.drafted
            )
        for request, out in results:
            if isinstance(out, Exception) or out.finish_reason is not None:
                self._release(request)
        return StepOutput(results, stats)

    def _fail(self, rows: list[StepRow], failure: PassFailed) -> StepOutput:
        """A pass that failed ends its requests; the engine goes on with the next step."""
        error = failure.__cause__ if isinstance(failure.__cause__, Exception) else failure
        log.error("a forward pass failed; ending the %d requests in it", len(rows), exc_info=error)
        for row in rows:
            self._finish(row.request, "error")
        return StepOutput([(row.request, error) for row in rows], None)

    def _drop_aborted(self) -> None:
        for request in self.scheduler.drop_aborted_waiting():  # a preempted one has drafted
            request.drafts.close()
        for request in [r for r in self.scheduler.running if r.aborted]:
            self._finish(request, "abort")

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = request.finish_reason or reason
        self._release(request)

    def _release(self, request: Request) -> None:
        request.drafts.close()
        self.scheduler.finish(request)

    # -- offline use (benchmarks, tests): the caller owns the engine ------------------------

    def generate(
        self, prompt_ids: Sequence[int], params: GenerationParams
    ) -> Iterator[RoundOutput]:
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

    def complete_many(
        self, requests: Sequence[tuple[Sequence[int], GenerationParams]]
    ) -> list[Completion]:
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
