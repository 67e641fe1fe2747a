"""Cross-request drafts: an index over the recent outputs of all requests (SuffixDecoding-style).

Requests of one deployment repeat each other: the same extraction task over many inputs, the
same answer skeletons, the same code idioms. A request's own context cannot know that; this
index, shared by every request (it lives on the `Mixer`), can. It proposes, for the newest
n tokens (n from the longest order down), what followed them in other outputs, ranked by count
then recency like the context strategy.

Memory is bounded by `capacity` tokens, whatever the traffic: tokens live in a ring buffer,
and each order n has a hash table `heads` (newest position of each n-gram's bucket) and a
chain `prev` (the previous position in the same bucket), as in LZ77 match finders. Writing
over the ring evicts the oldest tokens; a chain is followed only while it stays inside the
window, and every hit is checked against the stored tokens, so stale links and hash
collisions cost a step, never a wrong draft.

Each request writes its output in chunks (`SuffixWriter`) so that one request's tokens stay
contiguous while requests interleave in one batch; a separator starts every chunk, and a
chunk repeats the last tokens of the one before as context, so an n-gram at the seam still
finds its continuation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from drafting.base import Draft
from drafting.context_ngram import first_distinct
from drafting.history import TokenHistory

SEPARATOR = -1  # starts every chunk: no n-gram spans it and no continuation crosses it
ORDERS = (4, 3, 2)  # n-gram lengths indexed, longest (most specific) first
DEFAULT_CAPACITY = 1_000_000  # tokens: about 40 MB of arrays


class SuffixIndex:
    """A bounded, hashed n-gram index over a ring buffer of tokens (positions are absolute)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, orders: Sequence[int] = ORDERS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        self.orders = tuple(sorted(orders, reverse=True))
        self.written = 0  # positions ever written; the window is [written - capacity, written)
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)  # [capacity] ring
        # buckets: a power of two ≥ capacity/2
        self._mask = (1 << max(capacity // 2, 1).bit_length()) - 1
        self._heads = {n: np.full(self._mask + 1, -1, dtype=np.int64) for n in self.orders}
        # by position % capacity
        self._prev = {n: np.full(capacity, -1, dtype=np.int64) for n in self.orders}

    @property
    def nbytes(self) -> int:
        """Bytes of every array the index holds (constant: fixed at construction)."""
        return self.tokens.nbytes + sum(
            a.nbytes for a in (*self._heads.values(), *self._prev.values())
        )

    def append(self, tokens: Sequence[int], context: Sequence[int] = ()) -> None:
        """Write a chunk: a separator, then `context` (the tokens before `tokens`, so that
        n-grams across the seam get their continuation) and `tokens`, registering every n-gram
        in the chunk."""
        self._write(SEPARATOR)
        start = self.written
        for token in [*context, *tokens]:
            self._write(token)
            self._register(self.written - 1, start)

    def continuations(
        self, ngram: tuple[int, ...], w: int, most_recent: int
    ) -> list[tuple[int, ...]]:
        """What followed the `most_recent` newest occurrences of `ngram` (those with anything
        after them), oldest first."""
        n = len(ngram)
        found: list[tuple[int, ...]] = []
        if n not in self._heads:
            return found
        end = int(self._heads[n][hash(ngram) & self._mask])
        while end >= self._oldest + n - 1 and len(found) < most_recent:
            if self._read(end - n + 1, end + 1) == ngram and (
                continuation := self._continuation(end + 1, w)
            ):
                found.append(continuation)
            end = int(self._prev[n][end % self.capacity])
        return found[::-1]

    @property
    def _oldest(self) -> int:
        return max(self.written - self.capacity, 0)

    def _write(self, token: int) -> None:
        self.tokens[self.written % self.capacity] = token
        self.written += 1

    def _register(self, end: int, chunk_start: int) -> None:
        for n in self.orders:
            if end - n + 1 < chunk_start:
                continue  # would span the separator
            bucket = hash(self._read(end - n + 1, end + 1)) & self._mask
            self._prev[n][end % self.capacity] = self._heads[n][bucket]
            self._heads[n][bucket] = end

    def _read(self, start: int, stop: int) -> tuple[int, ...]:
        return tuple(int(self.tokens[p % self.capacity]) for p in range(start, stop))

    def _continuation(self, start: int, w: int) -> tuple[int, ...]:
        tokens = self._read(start, min(start + w, self.written))
        return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens


@dataclass
class SuffixWriter:
    """One request's output on its way into the shared index, a chunk at a time."""

    index: SuffixIndex
    chunk: int = 64  # tokens per write
    # last tokens repeated before the next chunk: n-grams there keep ~8 tokens of continuation
    seam: int = 12
    _pending: list[int] = field(default_factory=list)
    _context: list[int] = field(default_factory=list)

    def add(self, tokens: Sequence[int]) -> None:
        self._pending.extend(tokens)
        if len(self._pending) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        """Write what is pending (the engine calls it when the request ends)."""
        if self._pending:
            self.index.append(self._pending, self._context)
            self._context = (self._context + self._pending)[-self.seam :]
            self._pending = []


@dataclass(frozen=True)
class Suffix:
    """Continuations of the newest n tokens found in other requests' outputs."""

    index: SuffixIndex
    most_recent: int = 32  # occurrences examined per order: bounds the work
    name: str = "suffix"
    # its drafts continue a match in text, so its worth comes and goes with the text: always asked
    follows_matches: ClassVar[bool] = True

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        if k <= 0 or w <= 0:
            return []
        tokens = history.token_ids
        by_n = (
            (n, self.index.continuations(tuple(tokens[-n:]), w, self.most_recent))
            for n in self.index.orders
            if n <= len(tokens)
        )
        return [Draft(c, self.name, rank, n) for rank, (n, c) in enumerate(first_distinct(by_n, k))]
