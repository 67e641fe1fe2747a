"""What the engine hands out: a request's round, a pass's statistics, a whole completion.

Plain values, so the HTTP edge and the benchmarks read them without touching the engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from service.engine.logprobs import TokenLogprob


@dataclass(slots=True)
class RoundOutput:
    """The tokens one round committed for one request, and what it cost. Filled in place by
    the step that makes it (its timings once every row is verified, rather than a copy a row),
    read-only once returned."""

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
    # of the step, this request's structured output (masks, drafts cut, ...)
    grammar_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # the request's prompt tokens the prefix cache gave

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
    # of `seconds`: planning, drafting and learning (what plain decoding does not do)
    draft_seconds: float
    # of `pass_seconds`: recording CUDA graphs of new pass shapes (once per shape)
    capture_seconds: float = 0.0
    # of `seconds`: the forward call (on a GPU it returns once the device has run the pass: the
    # logits are gathered by an index from the host, a copy that waits); the rest, `seconds -
    # draft_seconds - pass_seconds`, is verification and the KV commit
    pass_seconds: float = 0.0
    # of `seconds`, on a device round's step (`service/device_round/`): the host waiting for the
    # device in the step's one copy back (the rest is host time on the step's critical path)
    wait_seconds: float = 0.0
    # device → host copies the host waited for: 1 on a device round's step (not counted elsewhere)
    syncs: int = 0


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
    grammar_seconds: float = 0.0

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
        self.grammar_seconds += round_output.grammar_seconds
        if round_output.predicted_tokens_per_second:
            self.predicted_seconds += (
                len(round_output.token_ids) / round_output.predicted_tokens_per_second
            )

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / self.num_passes if self.num_passes else 0.0
