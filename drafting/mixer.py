"""Split k speculation slots among strategies by how well each has been accepted.

Each candidate is valued by the expected number of its tokens the model will accept,
estimated per (strategy, rank, order) with the censored geometric model of `acceptance.py`
(`Draft.order`: the length of the match a context or suffix draft continues). Every
round, *every* candidate a strategy proposed — chosen or not — is scored against the tokens
the model actually committed, so a strategy that gets no slot is still measured and can win
slots back (in auto mode, in the rounds it is asked: `chosen`). A request's own statistics
dominate once it has some; until then the global ones (over all requests) stand in as the
prior.

The k best-valued candidates are chosen, skipping any that would add no node to the tree
(a duplicate, or a prefix of one already chosen). Strategies that run a model report their
measured seconds per drafted token, handed on with each candidate for the controller to
charge, and draft all of a step's requests at once: the engine hands the mixer every request's
ask first (`prepare`). Which strategies are asked, and for how much, follows what the
controller took (`chosen`).

Each request has its own draft state (`RequestDrafts`); the `Mixer` that opens them is
shared and holds the global statistics and the state strategies share across requests: the
successor tables the passes' distributions refresh, the index of all requests' outputs, and
how long a new request waits before asking a costly strategy others kept passing over.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from drafting.acceptance import Acceptance, AcceptanceCounts, blend
from drafting.base import BatchStrategy, Draft, PassDistributions, Strategy, common_prefix
from drafting.history import TokenHistory
from drafting.model_ngram import TableSlot
from drafting.recycled import SuccessorTable
from drafting.suffix import SuffixIndex, SuffixWriter

MIXED = "mixed"
SEPARATOR = "+"  # "context+self_draft": a mix of some strategies
CONTEXT = "context"  # its short drafts are lengthened by bigram chaining in mixed mode
REQUEST_PRIOR_WEIGHT = 4.0  # global statistics count as this many observations of a request
UNSEEN = Acceptance(p=0.5, c=0.5)  # optimistic start, so every key gets tried
# a costly strategy passed over is asked again after 8, 16, ... 128 rounds
PROBE_FIRST, PROBE_LAST = (8, 128)
CHEAP_GRACE = 8  # rounds in a row the controller may pass a cheap strategy over before it waits too
# ... after 8, 16, then every 32 rounds: a copy to draft from may start any time
CHEAP_PROBE_LAST = 32
REACH_SLACK = 2  # drafts and depth asked for beyond twice what the controller took last round

Key = tuple[str, int, int]  # (strategy, rank, order): see `Draft.order`


class ScoredDraft(NamedTuple):
    """A candidate, the acceptance estimated for its key (strategy, rank, order), and what
    drafting one token of it costs (measured by strategies that run a model; the controller
    counts it). A named tuple, as `Acceptance`: one per candidate per round."""

    draft: Draft
    acceptance: Acceptance
    seconds_per_token: float = 0.0


class Mixer:
    """Holds the strategies, the global statistics and the shared tables; opens a
    `RequestDrafts` per request.

    `standalone` strategies may be selected alone but stay out of `mixed` (a baseline the
    benchmark compares against). `successors` are refreshed from the distributions of every pass
    of the requests that draft from them;
    `suffix` indexes every request's output.
    """

    def __init__(
        self,
        strategies: Iterable[Strategy],
        tables: TableSlot | None = None,
        *,
        standalone: Iterable[Strategy] = (),
        successors: Iterable[SuccessorTable] = (),
        suffix: SuffixIndex | None = None,
    ) -> None:
        self.strategies = {s.name: s for s in strategies}
        self.standalone = {s.name: s for s in standalone}
        # names of those that draft many requests at once (a protocol check is slow per call)
        self.batched: dict[str, BatchStrategy] = {
            s.name: s for s in self.every_strategy if isinstance(s, BatchStrategy)
        }
        self.tables = tables or TableSlot()
        self.successors = list(successors)
        self.suffix = suffix
        self.global_counts: dict[Key, AcceptanceCounts] = defaultdict(AcceptanceCounts)
        self._priors: dict[Key, Acceptance] = {}  # `prior` of each key, until its counts change
        self._leading: set[Key] = set()  # the recorded keys of each strategy's best draft (rank 0)
        # costly strategy -> the rounds a new request waits before asking it: the wait the
        # last request that kept passing it over had reached (none once one takes it again)
        self.probe_waits: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        """Names a request may select: each strategy and `mixed` (all but the standalone ones)."""
        return [*self.strategies, *self.standalone, MIXED]

    @property
    def every_strategy(self) -> list[Strategy]:
        """The strategies of `mixed` and the standalone ones."""
        return [*self.strategies.values(), *self.standalone.values()]

    @property
    def kv_bytes_per_token(self) -> int:
        """Memory the strategies hold per token of a request (draft models' KV rows): a
        request may use all of them, so a KV budget counts the sum."""
        return sum(s.kv_bytes_per_token for s in self.batched.values())

    @property
    def distribution_top_k(self) -> int:
        """How many of each tree node's likeliest next tokens the engine should hand over
        after a pass (0: no strategy learns from them, skip the work)."""
        return max((table.top_k for table in self.successors), default=0)

    def for_request(self, prompt_ids: Sequence[int], strategy: str = MIXED) -> RequestDrafts:
        """A request's drafting with one strategy, `mixed` (all but the standalone ones), or a
        mix named "a+b"."""
        every = self.strategies | self.standalone
        names = list(self.strategies) if strategy == MIXED else strategy.split(SEPARATOR)
        unknown = [name for name in names if name not in every]
        if unknown or not names:
            raise ValueError(
                f"unknown strategy {strategy!r}; choose from {', '.join(self.names)} "
                f"or join several with {SEPARATOR!r}"
            )
        chosen = [every[name] for name in dict.fromkeys(names)]
        return RequestDrafts(
            TokenHistory(prompt_ids), chosen, self, extend_short_drafts=len(chosen) > 1
        )

    def prepare(self, asks: Sequence[tuple[RequestDrafts, int, int]]) -> None:
        """Before a step's requests are asked for (k, w) drafts each: strategies that draft
        many requests at once (a draft model, one pass for all) get every ask they will be
        asked this step, so that each request's own ask then finds its drafts ready."""
        batches: dict[str, list[tuple[TokenHistory, int, int]]] = defaultdict(list)
        for drafts, k, w in asks:
            k, w, asked = drafts.asks(k, w)
            for strategy in asked:
                if strategy.name in self.batched:
                    batches[strategy.name].append((drafts.history, k, w))
        for name, batch in batches.items():
            self.batched[name].prepare(batch)

    def prior(self, key: Key) -> Acceptance:
        """Global estimate for (strategy, rank, order). Kept until the key's counts change:
        every request of a step asks for the same few keys."""
        prior = self._priors.get(key)
        if prior is None:
            unseen = Acceptance(UNSEEN.p / (key[1] + 1), UNSEEN.c)
            prior = self._priors[key] = blend(self.global_counts[key], unseen, prior_weight=1.0)
        return prior

    def record(self, key: Key, accepted: int, cap: int, shared: int = 0) -> None:
        """A candidate of (strategy, rank, order) `key` matched `accepted` of at most `cap`
        tokens, the first `shared` held by a better candidate (`AcceptanceCounts.observe`)."""
        self.global_counts[key].observe(accepted, cap, shared)
        self._priors.pop(key, None)
        if key[1] == 0:
            self._leading.add(key)

    def best_acceptance(self, w: int) -> Acceptance:
        """The estimate, over all requests, of the likeliest draft of up to `w` tokens seen so
        far: the best (strategy, order) of any strategy's first-ranked drafts (an untried
        strategy's optimistic start before any is recorded). What the controller may hope of a
        draft before drafting any (`service.controller.planner.best_draft_pays`)."""
        return max(
            (self.prior(key) for key in self._leading),
            key=lambda a: a.expected_tokens(w),
            default=UNSEEN,
        )


class RequestDrafts:
    """One request's drafting: propose drafts each round, learn from what was committed."""

    def __init__(
        self,
        history: TokenHistory,
        strategies: list[Strategy],
        mixer: Mixer,
        extend_short_drafts: bool,
    ) -> None:
        self.history = history
        self.strategies = strategies
        self.mixer = mixer
        self.extend_short_drafts = extend_short_drafts
        self.counts: dict[Key, AcceptanceCounts] = defaultdict(AcceptanceCounts)
        self._candidates: list[Draft] = []
        self._writer = SuffixWriter(mixer.suffix) if mixer.suffix is not None else None
        # strategies the controller passes over; a new request starts where others left the costly
        # ones
        self._skipped = {
            s.name: _Skipped(0, mixer.probe_waits[s.name])
            for s in strategies
            if s.name in mixer.probe_waits
        }
        self._reach: tuple[int, int] | None = None  # (drafts, depth) worth asking for; None: all
        # how many of each draft's tokens the request's output may take next (structured output);
        # None: all
        self.legal_lengths: Callable[[Sequence[Sequence[int]]], list[int]] | None = None
        # the shared successor tables its strategies read: they alone learn from its passes
        self.tables = [
            t for t in mixer.successors if any(getattr(s, "table", None) is t for s in strategies)
        ]

    def acceptance(self, draft: Draft) -> Acceptance:
        key = (draft.strategy, draft.rank, draft.order)
        return blend(self.counts[key], self.mixer.prior(key), REQUEST_PRIOR_WEIGHT)

    def candidates(self, k: int, w: int) -> list[ScoredDraft]:
        """Up to k drafts of ≤ w tokens from each strategy (fewer, shorter ones while the
        controller takes few: see `chosen`), best expected acceptance first."""
        k, w, asked = self.asks(k, w)
        drafts = [d for s in asked for d in self._lengthen(s.propose(self.history, k, w), w)]
        self._candidates = list(dict.fromkeys(self._legal(drafts)))
        costs = {s.name: _cost(s) for s in self.strategies}
        scored = [
            ScoredDraft(d, self.acceptance(d), costs.get(d.strategy, 0.0)) for d in self._candidates
        ]
        scored.sort(
            key=lambda s: s.acceptance.expected_tokens(len(s.draft.token_ids)), reverse=True
        )
        self._candidates = [s.draft for s in scored]  # best first: `observe` scores in this order
        return scored

    def asks(self, k: int, w: int) -> tuple[int, int, list[Strategy]]:
        """What `candidates(k, w)` asks for, and of which strategies (see `chosen`)."""
        if self._reach is not None:
            k, w = min(k, self._reach[0]), min(w, self._reach[1])
        return (
            k,
            w,
            [
                s
                for s in self.strategies
                if s.name not in self._skipped or self._skipped[s.name].due
            ],
        )

    def propose(self, k: int, w: int) -> list[Draft]:
        """The k most valuable drafts that each add a node to the tree."""
        return select(self.candidates(k, w), k, w)

    def chosen(self, drafts: Sequence[Draft]) -> None:
        """What the controller took this round. A costly strategy (one that runs a model) it
        passed over is asked again only after `PROBE_FIRST` rounds, doubling up to
        `PROBE_LAST` while it keeps losing: its drafting time is saved, yet it is still
        measured and can win back. The wait carries over to requests that start later, until
        some request takes the strategy again.
        A cheap strategy (a table look-up) waits likewise once passed over `CHEAP_GRACE` rounds
        in a row, up to every `CHEAP_PROBE_LAST`th round, its wait the request's own: where the
        controller keeps every row plain its time is paid for nothing. Strategies that continue
        a match in text (`follows_matches`) are always asked: a copy to draft from may start
        any round.
        The next round asks every strategy for twice the drafts and depth taken, plus
        `REACH_SLACK`, so the ask follows the choice within a round or two; drafting all k × w
        for rows the controller keeps plain is dear (docs/benchmarks.md, "Figures behind
        design choices")."""
        deepest = max((len(d.token_ids) for d in drafts), default=0)
        self._reach = (2 * len(drafts) + REACH_SLACK, 2 * deepest + REACH_SLACK)
        used = {d.strategy for d in drafts}
        for strategy in self.strategies:
            if strategy.name in used:
                self._skipped.pop(strategy.name, None)
                self.mixer.probe_waits.pop(strategy.name, None)
                continue
            costly = _cost(strategy) > 0
            if not costly and getattr(strategy, "follows_matches", False):
                continue
            skipped = self._skipped.get(strategy.name)
            if skipped is None:
                skipped = self._skipped[strategy.name] = (
                    _Skipped() if costly else _Skipped(grace=CHEAP_GRACE, last=CHEAP_PROBE_LAST)
                )
            skipped.round_passed()
            if costly:
                self.mixer.probe_waits[strategy.name] = skipped.wait

    def observe(self, committed: Sequence[int]) -> None:
        """Score every candidate of the round against the committed tokens; extend history.

        A candidate is scored on the nodes it adds to those of the better-valued candidates
        before it (the tree holds a node once, and the controller credits it to the first
        draft through it): where two strategies guess the same next token, the node counts for
        the better one, and the other's first-token estimate is learned on the rounds it
        guessed a token of its own. Scored whole, the extended bigram's and the logit
        strategy's first guesses, mostly the recycled table's top one again, were estimated far
        likelier than the nodes they alone added were accepted (docs/benchmarks.md, "Scoring
        drafts on the nodes they add").
        Only a candidate's first len(committed) tokens can be scored, so only they enter the
        held nodes, which saves time and changes no count."""
        held: dict[int, dict] = {}  # the scorable nodes of the candidates scored so far, as a trie
        counts, record, depth = self.counts, self.mixer.record, len(committed)
        for draft in self._candidates:
            tokens = draft.token_ids[:depth]
            node, shared = held, 0
            for token in tokens:
                child = node.get(token)
                if child is None:
                    break
                node, shared = child, shared + 1
            for token in tokens[shared:]:  # a trie, not a set of prefixes: no tuple per node
                child = {}  # (measured faster than a set of prefixes: docs/benchmarks.md)
                node[token] = child
                node = child
            cap = len(tokens)
            if cap <= shared:
                continue  # each node it could be scored on is a better draft's: nothing to learn
            key = (draft.strategy, draft.rank, draft.order)
            accepted = common_prefix(tokens, committed)
            counts[key].observe(accepted, cap, shared)
            record(key, accepted, cap, shared)
        self._candidates = []
        self.history.extend(committed)
        if self._writer is not None:
            self._writer.add(committed)

    @property
    def learns_from_passes(self) -> bool:
        """Whether its passes' top next tokens are worth handing over (`observe_distributions`)."""
        return bool(self.tables)

    def observe_distributions(self, passed: PassDistributions) -> None:
        """After `observe`: the pass's top next tokens at every node refresh the successor
        tables this request's strategies read, and those at the node that chose the newest
        token become the history's hints. Only those tables: a mixed request refreshing the
        Token Recycling baseline's table too paid a second update a pass for a strategy no
        request of it drafts with."""
        for table in self.tables:
            table.observe(passed)
        self.history.hints = tuple(int(t) for t in passed.top_ids[passed.stop_node])

    def close(self) -> None:
        """The request ended: its last output goes into the shared index, and strategies
        that hold state per request (a draft model's KV row) free it."""
        if self._writer is not None:
            self._writer.flush()
        for strategy in self.strategies:
            if strategy.name in self.mixer.batched:
                self.mixer.batched[strategy.name].release(self.history)

    def restrict(
        self, legal_lengths: Callable[[Sequence[Sequence[int]]], list[int]], strategy: Strategy
    ) -> None:
        """Hold the request's drafts to what its output may take (`legal_lengths`: how many of
        each draft's tokens, a grammar's rule) and draft with `strategy` too (what the rule
        forces)."""
        self.legal_lengths = legal_lengths
        self.strategies.append(strategy)

    def _legal(self, drafts: list[Draft]) -> list[Draft]:
        """Each draft cut where the output may not take it (a grammar's rule), before it costs
        a place in the pass; a draft with no legal token is dropped."""
        if self.legal_lengths is None:
            return drafts
        kept = []
        for draft, legal in zip(drafts, self.legal_lengths([d.token_ids for d in drafts])):
            if legal:
                kept.append(
                    draft
                    if legal == len(draft.token_ids)
                    else Draft(draft.token_ids[:legal], draft.strategy, draft.rank, draft.order)
                )
        return kept

    def _lengthen(self, drafts: list[Draft], w: int) -> list[Draft]:
        tables = self.mixer.tables.tables
        if not self.extend_short_drafts or tables is None:
            return drafts
        return [
            Draft(tables.chain(d.token_ids, w), d.strategy, d.rank, d.order)
            if d.strategy == CONTEXT
            else d
            for d in drafts
        ]


@dataclass
class _Skipped:
    """Rounds since a strategy the controller passes over was last asked, and the wait
    before it is asked again."""

    rounds: int = -1  # the round it was passed over in counts as its last probe
    wait: int = PROBE_FIRST
    grace: int = 0  # rounds it is still asked in, passed over or not, before it waits
    last: int = PROBE_LAST  # the longest wait

    @property
    def due(self) -> bool:
        return self.grace > 0 or self.rounds >= self.wait

    def round_passed(self) -> None:
        if self.grace > 0:  # asked and passed over: the last such round counts as its last probe
            self.grace, self.rounds = self.grace - 1, 0
        elif self.due:  # it was asked (probed) this round and lost again: wait longer
            self.rounds, self.wait = 0, min(self.wait * 2, self.last)
        else:
            self.rounds += 1


def _cost(strategy: Strategy) -> float:
    """Seconds per drafted token: measured by strategies that run a model, else 0."""
    return float(getattr(strategy, "seconds_per_token", 0.0))


def select(scored: Sequence[ScoredDraft], k: int, w: int) -> list[Draft]:
    """Take drafts in order, cut to w tokens, skipping those that add no tree node."""
    chosen: list[Draft] = []
    nodes: set[tuple[int, ...]] = set()
    for candidate in scored:
        if len(chosen) == k:
            break
        tokens = candidate.draft.token_ids[:w]
        if tokens not in nodes:
            chosen.append(
                Draft(tokens, candidate.draft.strategy, candidate.draft.rank, candidate.draft.order)
            )
            nodes.update(tokens[:depth] for depth in range(1, len(tokens) + 1))
    return chosen
