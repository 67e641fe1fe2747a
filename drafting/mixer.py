"""Split k speculation slots among strategies by how well each has been accepted.

Value of a candidate = the expected number of its tokens the model will accept, estimated
per (strategy, rank) from running statistics. Every round, *every* candidate a strategy
proposed — chosen or not — is scored against the tokens the model actually committed (the
length of their common prefix), so a strategy that gets no slot still gets measured and can
win slots back; no exploration schedule is needed. A request's own statistics dominate once
it has some; until then the global ones (over all requests) stand in as the prior.

The k best-valued candidates are chosen, skipping any that repeat (or are a prefix of) one
already chosen: the tree would merge them and the slot would be wasted. Draft sessions are
per request; the `Mixer` that makes them is shared and holds the global statistics.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from drafting.base import Draft, Strategy
from drafting.history import TokenHistory
from drafting.model_ngram import TableSlot

MIXED = "mixed"
CONTEXT = "context"  # its short drafts are lengthened by bigram chaining in mixed mode
REQUEST_PRIOR_WEIGHT = 4.0  # global statistics count as this many observations of a request


@dataclass
class RunningMean:
    total: float = 0.0
    count: float = 0.0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def blended(self, prior: float, prior_weight: float) -> float:
        return (self.total + prior * prior_weight) / (self.count + prior_weight)


Key = tuple[str, int]  # (strategy, rank)


@dataclass
class AcceptanceStats:
    """Mean accepted length per (strategy, rank)."""

    means: dict[Key, RunningMean] = field(default_factory=lambda: defaultdict(RunningMean))

    def observe(self, draft: Draft, accepted: int) -> None:
        self.means[(draft.strategy, draft.rank)].add(accepted)


class Mixer:
    """Holds the strategies and the global statistics; opens a `DraftSession` per request."""

    def __init__(self, strategies: Iterable[Strategy], tables: TableSlot | None = None) -> None:
        self.strategies = {s.name: s for s in strategies}
        self.tables = tables or TableSlot()
        self.global_stats = AcceptanceStats()

    @property
    def names(self) -> list[str]:
        """Names a request may select: each strategy and `mixed` (all of them)."""
        return [*self.strategies, MIXED]

    def session(self, prompt_ids: Sequence[int], strategy: str = MIXED) -> DraftSession:
        if strategy not in self.names:
            raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(self.names)}")
        chosen = list(self.strategies.values()) if strategy == MIXED else [self.strategies[strategy]]
        return DraftSession(TokenHistory(prompt_ids), chosen, self, extend_short_drafts=strategy == MIXED)

    def prior(self, key: Key) -> float:
        """Global mean for (strategy, rank); unseen keys start optimistic so they get tried."""
        return self.global_stats.means[key].blended(prior=1.0 / (key[1] + 1), prior_weight=1.0)


class DraftSession:
    """One request's drafting: propose k drafts per round, learn from what was committed."""

    def __init__(
        self, history: TokenHistory, strategies: list[Strategy], mixer: Mixer, extend_short_drafts: bool
    ) -> None:
        self.history = history
        self.strategies = strategies
        self.mixer = mixer
        self.extend_short_drafts = extend_short_drafts
        self.stats = AcceptanceStats()
        self._candidates: list[Draft] = []

    def value(self, draft: Draft) -> float:
        key = (draft.strategy, draft.rank)
        return self.stats.means[key].blended(self.mixer.prior(key), REQUEST_PRIOR_WEIGHT)

    def propose(self, k: int, w: int) -> list[Draft]:
        """The k most valuable distinct drafts of ≤ w tokens over all strategies."""
        self._candidates = [d for s in self.strategies for d in self._lengthen(s.propose(self.history, k, w), w)]
        chosen: list[Draft] = []
        for draft in sorted(self._candidates, key=self.value, reverse=True):
            if len(chosen) == k:
                break
            if not any(c.token_ids[: len(draft.token_ids)] == draft.token_ids for c in chosen):
                chosen.append(draft)
        return chosen

    def observe(self, committed: Sequence[int]) -> None:
        """Score every candidate of the round against the committed tokens; extend history."""
        for draft in self._candidates:
            accepted = _common_prefix(draft.token_ids, committed)
            self.stats.observe(draft, accepted)
            self.mixer.global_stats.observe(draft, accepted)
        self._candidates = []
        self.history.extend(committed)

    def _lengthen(self, drafts: list[Draft], w: int) -> list[Draft]:
        tables = self.mixer.tables.tables
        if not self.extend_short_drafts or tables is None:
            return drafts
        return [
            Draft(tables.chain(d.token_ids, w), d.strategy, d.rank) if d.strategy == CONTEXT else d
            for d in drafts
        ]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
