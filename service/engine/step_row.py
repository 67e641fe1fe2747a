"""One running request's part of a step, and the step's rounds.

A `StepRow` is immutable: the scheduler makes it (the request and the prompt chunk the pass
carries), the policy returns it with a tree (`with_tree`), and the step's path (host or
device) reads it to run the pass and verify. Nothing downstream writes into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from service.engine.logprobs import TokenLogprob
from service.engine.outputs import RoundOutput, StepStats
from service.engine.request import Request
from service.model.runner import RowInput
from service.model.tree import TokenTree, chain_tree, prepend_chain


@dataclass(frozen=True, eq=False)
class StepRow:
    """A running request's part of a pass (compared by identity: one per request a step)."""

    request: Request
    chunk: list[int]  # prompt tokens this pass puts in the cache
    tree: TokenTree | None = None  # the speculation tree; None: a prompt chunk alone
    k: int = 0  # the (k, w) shape the tree was built for
    w: int = 0
    forecast: float | None = None  # the controller's expected tokens per second (auto mode)

    @property
    def decoding(self) -> bool:
        """The row's prompt is in the cache after this pass's chunk: it carries a tree."""
        return self.request.prefill_remaining == len(self.chunk)

    @property
    def width(self) -> int:
        """Tokens the row brings to the pass."""
        return len(self.chunk) + (self.tree.num_nodes if self.tree else 0)

    def with_tree(self, tree: TokenTree, k: int, w: int, forecast: float | None = None) -> StepRow:
        return replace(self, tree=tree, k=k, w=w, forecast=forecast)

    def input(self) -> RowInput:
        if self.tree is None:
            return RowInput(chain_tree(self.chunk), logits_from=len(self.chunk))
        return RowInput(prepend_chain(self.chunk, self.tree), logits_from=len(self.chunk))


@dataclass(frozen=True)
class StepRounds:
    """What a step's path returns: its rows (with their trees) and each row's round, the
    error that ended its request, or None for a prompt chunk alone."""

    rows: list[StepRow]
    rounds: list[RoundOutput | Exception | None]
    wait_seconds: float = 0.0  # the host waiting for the device (a device round's step)
    syncs: int = 0  # device → host copies the host waited for


class StepOutput(NamedTuple):
    """A step's rounds, each with its request (or the error that ended it), and the pass's
    statistics (None when nothing ran)."""

    rounds: list[tuple[Request, RoundOutput | Exception]]
    stats: StepStats | None


class PassFailed(Exception):
    """The step's pass failed: every request in it ends (the engine goes on)."""


def take_round(
    row: StepRow,
    committed: list[int],
    accepted_strategies: list[str],
    drafted_by_strategy: dict[str, int],
    num_draft_tokens: int,
    logprobs: Callable[[list[int]], list[TokenLogprob]] | None = None,
    grammar_seconds: float = 0.0,
) -> RoundOutput:
    """The round `row`'s request takes of the `committed` tokens (cut after a stop token or at
    its budget, `truncate`), counted on the request; the only place a `RoundOutput` is made
    (the step's times are stamped on once every row is verified). `logprobs`: a function of
    the taken tokens giving their logprobs, or None."""
    request = row.request
    token_ids, finish_reason = truncate(committed, request.stop_ids, request.token_budget)
    request.num_generated += len(token_ids)
    request.finish_reason = finish_reason
    return RoundOutput(
        token_ids=token_ids,
        logprobs=None if logprobs is None else logprobs(token_ids),
        num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=len(accepted_strategies),
        accepted_strategies=accepted_strategies,
        drafted_by_strategy=drafted_by_strategy,
        draft_seconds=0.0,
        forward_seconds=0.0,
        finish_reason=finish_reason,
        grammar_seconds=grammar_seconds,
        k=row.k,
        w=row.w,
        predicted_tokens_per_second=row.forecast,
        cached_prompt_tokens=request.num_prefix_cached,
    )


def truncate(
    token_ids: list[int], stops: frozenset[int], budget: int
) -> tuple[list[int], str | None]:
    """Cut a round's tokens after the first stop token, or at the remaining token budget."""
    for i, token in enumerate(token_ids[:budget]):
        if token in stops:
            return token_ids[: i + 1], "stop"
    if len(token_ids) >= budget:
        return token_ids[:budget], "length"
    return token_ids, None
