"""Recycled drafts: next-token candidates kept from the distributions every pass computes.

A verification pass yields the model's next-token distribution at every tree node and keeps
one choice per node; Token Recycling (Luo et al., 2024) keeps the rest too. For each token x,
the top-K tokens the model last predicted after x (anywhere: any node of any tree of any
request) form a row of a [vocab, K] successor table, overwritten in place by each pass. Unlike
the model bigram table (x alone, computed once), a row reflects x in recent real contexts.

Drafts grow from the newest token along a static tree template of *rank paths*: the path
(0, 2, 0) takes the newest token's top successor, then that token's third, then its top
one. The template is fixed per (k, w); the mixer ranks its branches by measured acceptance
per (strategy, rank). Rows never observed fall back to the model bigram table if it exists.

The mix's table also keys rows by the last *two* tokens: a node's distribution is what the
model predicts after its parent's token and its own, so each pass fills a (previous, token)
row too, in a fixed hashed array where the newest pair wins a bucket. A draft steps from the
pair row where a pass saw the pair, else from the one-token row: after "of the" and after
"in the" the model rarely predicts the same, and a one-token row holds whichever came last.
Fixed k=8, w=8, 26 Spec-Bench prompts x 128 tokens: the mix 2.29 -> 2.45 tokens a pass
(docs/recycled-drafts.md). Token Recycling keys by one token, so its baseline table keeps no
pair rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit

from drafting.base import Draft, PassDistributions
from drafting.history import TokenHistory
from drafting.model_ngram import TableSlot

SUCCESSORS = 8  # K: candidates kept per token (the model bigram table's width too)
# how likely the model's next token is its r-th candidate, roughly: shapes the template only
RANK_PRIOR = (0.5, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.01)
GROWTH = 4096  # rows added at a time: few copies, little slack past the vocabulary
PAIR_BITS = 16  # 2**16 (previous, token) rows: 2.5 MiB with their keys, whatever the traffic
CACHED_ROWS = 8192  # rows kept as Python lists too (~440 bytes each, measured): 3.6 MB at most


class SuccessorTable:
    """[vocab, K] next-token candidates per token, refreshed in place from every pass.

    Memory is about vocab × K × 4 bytes (1.5 MiB for a 49k vocabulary), whatever the traffic:
    the array grows (in steps of `GROWTH` rows) only up to the largest token id seen, which the
    vocabulary bounds; plus at most ~`CACHED_ROWS` rows read as lists (3.6 MB). With
    `pair_bits`, 2**pair_bits rows keyed by (previous token, token) besides, allocated once
    (their keys stored, so a bucket another pair took reads as unseen, never as that pair's
    row), and as many cached as lists at most. A pass updates the arrays in one compiled
    call; the engine steps on one thread, so requests sharing the table never update it at
    the same time. A token (or pair) seen at several nodes of one pass keeps the last.
    """

    def __init__(self, top_k: int = SUCCESSORS, fallback: TableSlot | None = None, pair_bits: int = 0) -> None:
        self.top_k = top_k
        self.fallback = fallback
        self.successors = np.full((0, top_k), -1, dtype=np.int32)  # [rows, K]; -1: never observed
        # rows read as lists, each kept until a pass observes its token (at most ~`CACHED_ROWS`):
        # every strategy of every request follows the same few rows, and reading the numpy
        # table a rank at a time took 30 of a k=4, w=4 round's 130 us of drafting; clearing
        # them all at each pass left a k=8, w=8 recycled draft reading ~60 rows anew, and
        # writing the observed rows through cost more than reading them when needed (2-core dev VM)
        self._rows: dict[int, list[int]] = {}
        self.pair_bits = pair_bits
        self.pair_keys = np.full(1 << pair_bits if pair_bits else 0, -1, dtype=np.int64)  # (previous << 32) | token
        self.pair_successors = np.full((len(self.pair_keys), top_k), -1, dtype=np.int32)
        self._pair_rows: dict[int, list[int]] = {}  # as `_rows`, for the pair rows, by key
        self.passes = 0  # passes observed

    @property
    def nbytes(self) -> int:
        return self.successors.nbytes + self.pair_keys.nbytes + self.pair_successors.nbytes

    @property
    def cached_rows(self) -> int:
        """Rows kept as Python lists besides the arrays (bounded by `CACHED_ROWS` and a pass, each kind)."""
        return len(self._rows) + len(self._pair_rows)

    def observe(self, passed: PassDistributions) -> None:
        self.passes += 1
        tokens = passed.node_tokens
        if len(tokens) == 0:
            return
        token_list = tokens.tolist()
        self._grow(max(token_list) + 1)  # rows for the tokens observed (a row's entries may be larger ids)
        top = passed.top_ids[:, : self.top_k]  # [num_nodes, ≤K]
        parents = passed.parent_tokens if self.pair_bits and passed.parent_tokens is not None else None
        keys, evicted = _refresh(self.successors, tokens, top, parents, self.pair_keys, self.pair_successors,
                                 self.pair_bits)
        if len(self._rows) > CACHED_ROWS:
            self._rows.clear()
        for token in token_list:  # read these rows anew
            self._rows.pop(token, None)
        if parents is None:
            return
        cached = self._pair_rows
        for key in evicted.tolist():  # pairs whose buckets this pass took over, or lost within it
            cached.pop(key, None)
        if len(cached) > CACHED_ROWS:
            cached.clear()
        # the next round's drafts step through the new pair rows first: read them as lists now
        cached.update((key, row) for key, row in zip(keys.tolist(), top.tolist()) if key >= 0)

    def row(self, token: int) -> list[int]:
        """The candidates after `token`, best first (empty if neither table knows it)."""
        row = self._rows.get(token)
        if row is not None:
            return row
        if token < len(self.successors):
            values = self.successors[token].tolist()
            if values[0] >= 0:
                row = self._rows[token] = [t for t in values if t >= 0]
                return row
        tables = self.fallback.tables if self.fallback is not None else None
        if tables is not None and token < len(tables.bigram):
            row = self._rows[token] = tables.successors(token, self.top_k)
            return row
        return []

    def pair_row(self, previous: int, token: int) -> list[int]:
        """The candidates after `previous` then `token`, best first (empty if no pass saw the
        pair since another took its bucket, or the table keeps no pair rows)."""
        key = previous << 32 | token
        row = self._pair_rows.get(key)
        if row is not None:
            return row
        row = []
        if self.pair_bits and previous >= 0:
            bucket = _bucket(previous, token, self.pair_bits)
            if self.pair_keys[bucket] == key:
                row = [t for t in self.pair_successors[bucket].tolist() if t >= 0]
        if len(self._pair_rows) > CACHED_ROWS:
            self._pair_rows.clear()
        self._pair_rows[key] = row
        return row

    def follow(self, token: int, ranks: tuple[int, ...], previous: int = -1) -> tuple[int, ...]:
        """The tokens after `token` (which `previous` preceded, -1: unknown) taking the
        successor of each rank in turn, each from the row of the last two tokens where a pass
        saw them, else from the last token's (shorter where a row runs out)."""
        path, rows, pair_rows, pairs = [], self._rows, self._pair_rows, self.pair_bits > 0
        for rank in ranks:  # the cached rows without a call: most steps
            row = None
            if pairs and previous >= 0:
                row = pair_rows.get(previous << 32 | token)
                if row is None:
                    row = self.pair_row(previous, token)
            if not row:
                row = rows.get(token) or self.row(token)
            if rank >= len(row):
                break
            previous, token = token, row[rank]
            path.append(token)
        return tuple(path)

    def _grow(self, rows: int) -> None:
        if rows > len(self.successors):
            grown = np.full((-(-rows // GROWTH) * GROWTH, self.top_k), -1, dtype=np.int32)
            grown[: len(self.successors)] = self.successors
            self.successors = grown


_MIX_PREVIOUS, _MIX_TOKEN = 0x5BD1E995, 0x7FEB352D  # odd multipliers below 2**31


def _bucket(previous: int, token: int, bits: int) -> int:
    """The bucket of the pair (previous, token): token ids below 2**32 keep every product
    below 2**63 (so numba's int64 arithmetic in `_refresh` agrees with Python's), and the bits
    taken from the middle of the products depend on all the low 31 bits of both ids."""
    return ((previous * _MIX_PREVIOUS ^ token * _MIX_TOKEN) >> 15) & ((1 << bits) - 1)


_bucket_compiled = njit(cache=True, inline="always")(_bucket)


@njit(cache=True, nogil=True)
def _refresh(successors, tokens, top, parents, pair_keys, pair_successors, bits):  # pragma: no cover - compiled
    """One pass's refresh of the arrays, in one compiled call: each node's top candidates
    become its token's row and, where `parents` is given, the row of (its parent's token, its
    token), which takes the pair's bucket over (the rest of a shorter row set to -1). Returns
    each node's pair key (-1: none) and the keys whose rows the cached lists must drop: the
    pairs whose buckets were taken over, and a pair that lost its bucket to a later node of
    this pass. As numpy calls, ~20 of them, the refresh took ~165 us of a k=4, w=4 step whose
    whole drafting took ~820 (2-core dev VM, just after the pass: every call ran cold); this
    call and the cached lists' upkeep take ~100 (k=8, w=8: ~250 -> ~170)."""
    n, width = top.shape
    for i in range(n):
        successors[tokens[i], :width] = top[i]
    keys = np.full(n, -1, np.int64)
    if parents is None:
        return keys, np.empty(0, np.int64)
    evicted = np.full(2 * n, -1, np.int64)
    buckets = np.zeros(n, np.int64)
    for i in range(n):
        if parents[i] < 0:  # the root of a one-token context has no previous token
            continue
        bucket = _bucket_compiled(np.int64(parents[i]), np.int64(tokens[i]), bits)
        buckets[i] = bucket
        keys[i] = np.int64(parents[i]) << 32 | np.int64(tokens[i])
        evicted[i] = pair_keys[bucket]
        pair_keys[bucket] = keys[i]
        pair_successors[bucket, :width] = top[i]
        pair_successors[bucket, width:] = -1
    for i in range(n):  # of pairs sharing a bucket in this pass, the last keeps it
        if keys[i] >= 0 and pair_keys[buckets[i]] != keys[i]:
            evicted[n + i] = keys[i]
            keys[i] = -1
    return keys, evicted


def compile_refresh() -> None:
    """Compile (or load from numba's cache) `_refresh` for the arrays the engine hands over,
    with pair rows and without, so that no request's first pass waits for it (~3 s the first
    time on the 2-core dev VM, ~0.3 s from the cache)."""
    tokens, top = np.zeros(1, np.int64), np.zeros((1, 1), np.int64)
    table = SuccessorTable(top_k=1, pair_bits=1)
    table._grow(1)
    for parents in (tokens, None):
        _refresh(table.successors, tokens, top, parents, table.pair_keys, table.pair_successors, 1)


@lru_cache(maxsize=64)
def rank_paths(k: int, w: int, prior: tuple[float, ...] = RANK_PRIOR) -> tuple[tuple[int, ...], ...]:
    """The static tree template: k rank paths of w ranks, chosen greedily, each adding the
    most expected accepted nodes (a node's chance: the product of `prior` along its path).

    The spine (0, 0, …) comes first; then branches that leave it early with the next ranks,
    so the tree is wide near the root and thin below, the shape Token Recycling uses.
    """
    if k <= 0 or w <= 0:
        return ()
    paths: list[tuple[int, ...]] = []
    nodes: set[tuple[int, ...]] = set()
    while len(paths) < k:
        branches = (
            prefix + (rank,) + (0,) * (w - len(prefix) - 1)
            for prefix in [(), *sorted(nodes)] if len(prefix) < w
            for rank in range(len(prior)) if prefix + (rank,) not in nodes
        )
        best = max(branches, key=lambda path: _gain(path, nodes, prior), default=None)
        if best is None:
            break
        paths.append(best)
        nodes.update(best[:depth] for depth in range(1, w + 1))
    return tuple(paths)


def _gain(path: tuple[int, ...], nodes: set[tuple[int, ...]], prior: tuple[float, ...]) -> float:
    """Expected accepted nodes `path` adds to the tree of `nodes`."""
    gain, chance = 0.0, 1.0
    for depth, rank in enumerate(path, start=1):  # plain floats: numpy's per-call overhead made the
        chance *= prior[rank]  # k=8, w=8 template take 9.4 ms at its first use, 2.2 ms so (2-core CPU)
        if path[:depth] not in nodes:
            gain += chance
    return gain


@dataclass(frozen=True)
class Recycled:
    """Drafts grown from a successor table along the static rank-path template.

    In the mix (`recycled`) the table is shared by all requests and falls back to the model
    bigram table; alone with its own table and no fallback it is Token Recycling
    (`token_recycling`, the baseline the benchmark compares against).
    """

    table: SuccessorTable
    name: str = "recycled"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        drafts: list[Draft] = []
        seen: set[tuple[int, ...]] = set()
        previous = history.token_ids[-2] if len(history) > 1 else -1
        for rank, ranks in enumerate(rank_paths(k, w)):
            tokens = self.table.follow(history.last_token, ranks, previous)
            if tokens and tokens not in seen:
                seen.add(tokens)
                drafts.append(Draft(tokens, self.name, rank))
        return drafts
