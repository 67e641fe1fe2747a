"""The contract between the engine and every draft strategy.

Each round the engine asks for up to k guesses of up to w tokens that would follow the
context; it merges them into a token tree and verifies them all in one forward pass. A
strategy sees only the request's token history (and, for the model-derived ones, tables of
token ids), never the model or the engine, so it can be tested on literal arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from drafting.history import TokenHistory


@dataclass(frozen=True)
class Draft:
    """One guessed continuation, the strategy that proposed it and its rank there (0 = best).

    `order`: for a strategy that continues a match of the context's newest tokens (context,
    suffix), the match's length. Acceptance is learned per (strategy, rank, order): long
    matches continue far more reliably than 1-token ones (docs/drafting.md), and one estimate
    over both made auto mode speculate on 1-token matches in free text, at a loss, and doubt
    long ones."""

    token_ids: tuple[int, ...]
    strategy: str
    rank: int = 0
    order: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a draft holds at least one token")


class Strategy(Protocol):
    """A draft strategy: ranked continuations of the history's newest token."""

    name: str

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        """Return at most `k` distinct drafts of at most `w` tokens each, best first."""
        ...


@runtime_checkable
class BatchStrategy(Strategy, Protocol):
    """A strategy that drafts for many requests at once (one that runs a model: one pass for
    all of them) and holds state per request (its KV row) until the request ends."""

    kv_bytes_per_token: int  # memory held per token of a request's context (a KV budget counts it)

    def prepare(self, asks: Sequence[tuple[TokenHistory, int, int]]) -> None:
        """Draft for every (history, k, w) at once; each `propose` this round then finds its
        drafts ready."""
        ...

    def release(self, history: TokenHistory) -> None:
        """The request of `history` ended: drop what is held for it."""
        ...


@dataclass(frozen=True)
class PassDistributions:
    """What one verification pass showed of the model's next-token distributions.

    Every tree node's logits were computed anyway; their top entries are what the recycled
    strategies learn from (all nodes, not only the accepted path). Plain integer arrays, so
    drafting never sees a tensor.
    """

    node_tokens: np.ndarray  # [num_nodes] int: the token at each tree node
    # [num_nodes, K] int: the model's likeliest next tokens after each node, best first
    top_ids: np.ndarray
    stop_node: int  # where verification stopped: its choice is the round's bonus token
    # [num_nodes] int: the token before each node (its parent's; the root's from the context, -1
    # if none); None: not known, so no table learns what follows a pair of tokens
    parent_tokens: np.ndarray | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (a draft's accepted length, say)."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
