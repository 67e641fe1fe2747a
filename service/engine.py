"""The decode loop: draft → tree → one forward pass → verify → compact the cache.

State convention (one everywhere): the cache holds every committed token but the newest;
that newest ("pending") token is fed as the root of the next tree. A plain decode step is
the one-node tree, so k = 0 runs through exactly the same code as speculation.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from drafting import DraftSession, Mixer
from service.config import GenerationParams, SpeculationParams
from service.kv_cache import TreeKVCache
from service.model_runner import ModelRunner
from service.calibration import Calibration, RequestCalibration
from service.regime import CostProfile, Shape, choose_shape
from service.tree import build_tree, chain_tree
from service.sampling import PositionUniforms
from service.verifier import verify


@dataclass(frozen=True)
class RoundOutput:
    """The tokens one round committed, and what it cost."""

    token_ids: list[int]  # committed by this round, truncated at a stop or at max_new_tokens
    num_draft_tokens: int  # drafted tree nodes (root excluded)
    num_accepted_tokens: int  # drafted tokens the model agreed with
    accepted_strategies: list[str]  # strategy of each accepted token, in order
    drafted_by_strategy: dict[str, int]  # tree nodes each strategy put in the tree
    draft_seconds: float
    forward_seconds: float
    finish_reason: str | None  # "stop" | "length" | None while generating
    k: int = 0  # the speculation shape this round used
    w: int = 0
    predicted_tokens_per_second: float | None = None  # the controller's forecast (auto mode)

    @property
    def realized_tokens_per_second(self) -> float:
        return len(self.token_ids) / (self.draft_seconds + self.forward_seconds)


@dataclass
class Completion:
    """A whole generation, gathered from its rounds."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_passes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_strategy: Counter[str] = field(default_factory=Counter)
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    seconds: float = 0.0

    def add(self, round_output: RoundOutput) -> None:
        self.token_ids.extend(round_output.token_ids)
        self.finish_reason = round_output.finish_reason
        self.num_passes += 1
        self.num_draft_tokens += round_output.num_draft_tokens
        self.num_accepted_tokens += round_output.num_accepted_tokens
        self.accepted_by_strategy.update(round_output.accepted_strategies)
        self.draft_seconds += round_output.draft_seconds
        self.forward_seconds += round_output.forward_seconds

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / self.num_passes if self.num_passes else 0.0


class ContextTooLong(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


class Engine:
    """Generates for one sequence at a time over a `ModelRunner` and a draft `Mixer`."""

    def __init__(
        self, runner: ModelRunner, mixer: Mixer, eos_token_ids: Sequence[int], max_context: int
    ) -> None:
        self.runner = runner
        self.mixer = mixer
        self.profile: CostProfile | None = None  # set once measured; auto mode needs it
        self.calibration = Calibration()  # how far auto mode's forecasts fall from what happens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams) -> Iterator[RoundOutput]:
        """Yield each round's committed tokens until a stop token or `max_new_tokens`."""
        if not prompt_ids:
            raise ValueError("the prompt holds no tokens")
        self.check_fits(len(prompt_ids), params.max_new_tokens)
        drafts = self.mixer.session(prompt_ids, params.strategy)
        calibration = self.calibration.session()
        uniforms = None if params.sampling.greedy else PositionUniforms(params.sampling.seed)
        cache = self._prefill(prompt_ids)
        stops = self.eos_token_ids | params.stop_token_ids
        generated = 0
        while True:
            budget = params.max_new_tokens - generated
            output = self._round(cache, drafts, calibration, uniforms, params, stops, budget)
            generated += len(output.token_ids)
            yield output
            if output.finish_reason is not None:
                return

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise `ContextTooLong` unless prompt + max_new_tokens fits the model's context."""
        if num_prompt_tokens + max_new_tokens > self.max_context:
            raise ContextTooLong(
                f"this model's context is {self.max_context} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens asks for {max_new_tokens} more "
                f"(at most {max(self.max_context - num_prompt_tokens, 0)} fit)"
            )

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> Completion:
        """Run `generate` to the end and gather the result."""
        completion, start = Completion(), time.perf_counter()
        for round_output in self.generate(prompt_ids, params):
            completion.add(round_output)
        completion.seconds = time.perf_counter() - start
        return completion

    def _prefill(self, prompt_ids: Sequence[int]) -> TreeKVCache:
        cache = self.runner.new_cache()
        if len(prompt_ids) > 1:
            prompt = chain_tree(prompt_ids[:-1])
            self.runner.forward(cache, [prompt], logits=False)
            cache.commit(0, range(prompt.num_nodes))
        return cache

    def _round(
        self,
        cache: TreeKVCache,
        drafts: DraftSession,
        calibration: RequestCalibration,
        uniforms: PositionUniforms | None,
        params: GenerationParams,
        stops: frozenset[int],
        budget: int,
    ) -> RoundOutput:
        started = time.perf_counter()
        shape = self._shape(drafts, calibration, params.speculation)
        tree = build_tree(drafts.history.last_token, shape.drafts, max_nodes=1 + shape.k * shape.w)
        drafted = time.perf_counter()
        logits = self.runner.forward(cache, [tree])
        assert logits is not None
        # reads the choices back: the pass is done when this returns
        verdict = verify(tree, logits[0], params.sampling, uniforms, first_position=len(drafts.history))
        verified = time.perf_counter()
        cache.commit(0, [0, *verdict.accepted_nodes])
        if shape.forecast is not None:
            calibration.observe(shape.forecast, len(verdict.accepted_nodes), verified - drafted)
        drafts.observe(verdict.token_ids)
        token_ids, finish_reason = _truncate(verdict.token_ids, stops, budget)
        return RoundOutput(
            token_ids=token_ids,
            num_draft_tokens=tree.num_nodes - 1,
            num_accepted_tokens=len(verdict.accepted_nodes),
            accepted_strategies=[tree.strategies[i] or "" for i in verdict.accepted_nodes],
            drafted_by_strategy=dict(Counter(s for s in tree.strategies[1:] if s)),
            draft_seconds=drafted - started,
            forward_seconds=verified - drafted,
            finish_reason=finish_reason,
            k=shape.k,
            w=shape.w,
            predicted_tokens_per_second=shape.forecast.tokens_per_second if shape.forecast else None,
        )

    def _shape(self, drafts: DraftSession, calibration: RequestCalibration, spec: SpeculationParams) -> Shape:
        """This round's drafts: the controller's choice in auto mode (once the cost profile
        exists), else k drafts of w tokens; none when off."""
        if spec.mode == "off" or spec.k == 0:
            return Shape(0, 0, [])
        if spec.mode == "auto" and self.profile is not None:
            candidates = drafts.candidates(spec.k, spec.w)
            return choose_shape(
                candidates, self.profile, len(drafts.history), spec.k, spec.w, calibration.correction()
            )
        return Shape(spec.k, spec.w, drafts.propose(spec.k, spec.w))


def _truncate(token_ids: list[int], stops: frozenset[int], budget: int) -> tuple[list[int], str | None]:
    """Cut a round's tokens after the first stop token, or at the remaining token budget."""
    for i, token in enumerate(token_ids[:budget]):
        if token in stops:
            return token_ids[: i + 1], "stop"
    if len(token_ids) >= budget:
        return token_ids[:budget], "length"
    return token_ids, None
