"""Context n-gram lookup ("prompt lookup"): guess that the text repeats itself.

The last n tokens of the context are looked up among their earlier occurrences (through the
request's incremental index, so a round costs the same at any context length); the tokens
that followed each occurrence are candidate continuations. Longer matches are more specific,
so n runs from `max_n` down to `min_n`; within one n, candidates are ranked by how often
they followed the match, then by how recently.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import ClassVar

from drafting.base import Draft
from drafting.history import TokenHistory

Match = tuple[int, tuple[int, ...]]  # (the match's length n, a continuation)


@dataclass(frozen=True)
class ContextNgram:
    """Proposes continuations that followed earlier occurrences of the context's suffix."""

    max_n: int = 4
    min_n: int = 1
    most_recent: int = 64  # occurrences examined per n: bounds the work on repetitive text
    name: str = "context"
    # its drafts continue a match in text, so its worth comes and goes with the text: always asked
    follows_matches: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        return [
            Draft(c, self.name, rank, n) for rank, (n, c) in enumerate(self.matches(history, k, w))
        ]

    def continuations(
        self, history: TokenHistory, k: int, w: int, tail: Sequence[int] = ()
    ) -> list[tuple[int, ...]]:
        """At most k distinct continuations (≤ w tokens) of history + `tail`, best first."""
        return [continuation for _, continuation in self.matches(history, k, w, tail)]

    def matches(
        self, history: TokenHistory, k: int, w: int, tail: Sequence[int] = ()
    ) -> list[Match]:
        """`continuations`, each with the length of the match it continues."""
        if k <= 0 or w <= 0:
            return []
        by_n = (
            (
                n,
                [
                    tuple(history.token_ids[start : start + w])
                    for start in history.continuation_starts(n, self.most_recent, tail)
                ],
            )
            for n in range(min(self.max_n, history.max_n), self.min_n - 1, -1)
        )
        return first_distinct(by_n, k)


def first_distinct(by_n: Iterable[tuple[int, Sequence[tuple[int, ...]]]], k: int) -> list[Match]:
    """Up to k distinct continuations, each with its match length n, taking the (n,
    continuations) lists in order (longest match first; read only as far as needed) and
    ranking within each by count, then by most recent occurrence (lists are oldest first)."""
    seen: set[tuple[int, ...]] = set()

    def distinct() -> Iterator[Match]:
        for n, continuations in by_n:
            for continuation in _ranked(continuations):
                if continuation and continuation not in seen:
                    seen.add(continuation)
                    yield n, continuation

    return list(islice(distinct(), k))


def _ranked(continuations: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    # most recent first: a stable sort keeps that among equal counts
    counts: dict[tuple[int, ...], int] = {}
    for continuation in reversed(continuations):
        counts[continuation] = counts.get(continuation, 0) + 1
    return sorted(counts, key=counts.__getitem__, reverse=True)
