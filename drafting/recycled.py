"""Recycled drafts: next-token candidates kept from the distributions every pass computes.

A verification pass yields the model's next-token distribution at every tree node and keeps
one choice per node; Token Recycling (Luo et al., 2024) keeps the rest too. For each token x,
the top-K tokens the model last predicted after x (anywhere: any node of any tree of any
request) form a row of a [vocab, K] successor table, overwritten in place by each pass. Unlike
the model bigram table (x alone, computed once), a row reflects x in recent real contexts.

Drafts grow from the newest token along a static tree template of *rank paths*: the path
(0, 2, 0) takes the newest token's top successor, then that token's third, then its top
one. The template is fixed per (k, w); the mixer ranks its branches by measured acceptance
per (strategy, rank, order). Rows never observed fall back to the model bigram table if it exists.

The mix's table also keys rows by the last *two* tokens: a node's distribution is what the
model predicts after its parent's token and its own, so each pass fills a (previous, token)
row too, in a fixed hashed array where the newest pair wins a bucket. A draft steps from the
pair row where a pass saw the pair, else from the one-token row: after "of the" and after
"in the" the model rarely predicts the same, and a one-token row holds whichever came last.
Pair rows raised the mix's tokens a pass (docs/benchmarks.md, "Rows by the last two tokens").
Token Recycling keys by one token, so its baseline table keeps no pair rows.
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
_NO_FALLBACK = np.zeros((0, 1), dtype=np.uint32)  # the model bigram table's type, no rows


class SuccessorTable:
    """[vocab, K] next-token candidates per token, refreshed in place from every pass.

    Memory is about vocab × K × 4 bytes (1.5 MiB for a 49k vocabulary), whatever the traffic:
    the array grows (in steps of `GROWTH` rows) only up to the largest token id seen, which the
    vocabulary bounds. With `pair_bits`, 2**pair_bits rows keyed by (previous token, token)
    besides, allocated once (their keys stored, so a bucket another pair took reads as unseen,
    never as that pair's row). A pass updates the arrays in one compiled call, and drafts walk
    them in one compiled call a strategy's round (`walk`); the engine steps on one thread, so
    requests sharing the table never update it at the same time. A token (or pair) seen at
    several nodes of one pass keeps the last.
    """

    def __init__(
        self, top_k: int = SUCCESSORS, fallback: TableSlot | None = None, pair_bits: int = 0
    ) -> None:
        self.top_k = top_k
        self.fallback = fallback
        self.successors = np.full((0, top_k), -1, dtype=np.int32)  # [rows, K]; -1: never observed
        self.pair_bits = pair_bits
        # (previous << 32) | token
        self.pair_keys = np.full(1 << pair_bits if pair_bits else 0, -1, dtype=np.int64)
        self.pair_successors = np.full((len(self.pair_keys), top_k), -1, dtype=np.int32)
        self.passes = 0  # passes observed

    @property
    def nbytes(self) -> int:
        return self.successors.nbytes + self.pair_keys.nbytes + self.pair_successors.nbytes

    def observe(self, passed: PassDistributions) -> None:
        self.passes += 1
        tokens = passed.node_tokens
        if len(tokens) == 0:
            return
        # rows for the tokens observed (a row's entries may be larger ids); a list's max, as
        # numpy's reduction measured slower just after the pass
        self._grow(max(tokens.tolist()) + 1)
        parents = (
            passed.parent_tokens if self.pair_bits and passed.parent_tokens is not None else None
        )
        _refresh(
            self.successors,
            tokens,
            passed.top_ids[:, : self.top_k],
            parents,
            self.pair_keys,
            self.pair_successors,
            self.pair_bits,
        )

    def row(self, token: int) -> list[int]:
        """The candidates after `token`, best first (empty if neither table knows it): the
        row a draft steps from where no pair row knows the last two tokens."""
        if token < len(self.successors) and self.successors[token, 0] >= 0:
            return [t for t in self.successors[token].tolist() if t >= 0]
        fallback = self._fallback()
        return fallback[token, : self.top_k].tolist() if token < len(fallback) else []

    def pair_row(self, previous: int, token: int) -> list[int]:
        """The candidates after `previous` then `token`, best first (empty if no pass saw the
        pair since another took its bucket, or the table keeps no pair rows)."""
        if not self.pair_bits or previous < 0:
            return []
        bucket = pair_bucket(previous, token, self.pair_bits)
        if self.pair_keys[bucket] != previous << 32 | token:
            return []
        return [t for t in self.pair_successors[bucket].tolist() if t >= 0]

    def walk(
        self,
        starts: Sequence[tuple[int, int]],
        paths: np.ndarray,
        depths: Sequence[int] | None = None,
    ) -> list[tuple[int, ...]]:
        """For each row of ranks (≥ 0) in `paths` (its first `depths[i]` ranks; all where not
        given), the tokens after its start (previous token, token; one start for every path, or
        one a path; -1: no previous token) taking the successor of each rank in turn, each from
        the pair row of the last two tokens where a pass saw them, else from the last token's
        row (`row`), shorter where a row runs out. One compiled call for all the paths: rows
        kept as Python lists made both the drafts and each pass's refresh (which kept those
        lists current) slower (docs/benchmarks.md, "What made it so")."""
        ends = np.array(starts, dtype=np.int64).reshape(-1, 2)
        taken = np.array([paths.shape[1]] if depths is None else depths, dtype=np.int64)
        out = np.empty(paths.shape, dtype=np.int64)
        lengths = _walk(
            self.successors,
            self.pair_keys,
            self.pair_successors,
            self.pair_bits,
            self._fallback(),
            ends,
            paths,
            taken,
            out,
        )
        return [tuple(path[:n]) for path, n in zip(out.tolist(), lengths.tolist())]

    def _fallback(self) -> np.ndarray:
        tables = self.fallback.tables if self.fallback is not None else None
        return tables.bigram if tables is not None else _NO_FALLBACK

    def _grow(self, rows: int) -> None:
        if rows > len(self.successors):
            grown = np.full((-(-rows // GROWTH) * GROWTH, self.top_k), -1, dtype=np.int32)
            grown[: len(self.successors)] = self.successors
            self.successors = grown


_MIX_PREVIOUS, _MIX_TOKEN = 0x5BD1E995, 0x7FEB352D  # odd multipliers below 2**31


def pair_bucket(previous: int, token: int, bits: int) -> int:
    """The bucket of the pair (previous, token), elementwise on int64 arrays and tensors too
    (the device tables hash alike): token ids below 2**32 keep every product below 2**63 (so
    numba's int64 arithmetic in `_refresh` and `_walk` agrees with Python's), and the bits taken
    from the middle of the products depend on all the low 31 bits of both ids."""
    return ((previous * _MIX_PREVIOUS ^ token * _MIX_TOKEN) >> 15) & ((1 << bits) - 1)


_bucket_compiled = njit(cache=True, inline="always")(pair_bucket)


@njit(cache=True, nogil=True)
def _refresh(
    successors, tokens, top, parents, pair_keys, pair_successors, bits
):  # pragma: no cover - compiled
    """One pass's refresh of the arrays, in one compiled call: each node's top candidates
    become its token's row and, where `parents` is given, the row of (its parent's token, its
    token), which takes the pair's bucket over (the rest of a shorter row set to -1). One call
    instead of a score of numpy calls, each of which ran cold just after the pass
    (docs/benchmarks.md, "What made it so")."""
    n, width = top.shape
    for i in range(n):
        successors[tokens[i], :width] = top[i]
    if parents is None:
        return
    for i in range(n):
        if parents[i] < 0:  # the root of a one-token context has no previous token
            continue
        bucket = _bucket_compiled(np.int64(parents[i]), np.int64(tokens[i]), bits)
        pair_keys[bucket] = np.int64(parents[i]) << 32 | np.int64(tokens[i])
        pair_successors[bucket, :width] = top[i]
        pair_successors[bucket, width:] = -1


@njit(cache=True, nogil=True)
def _walk(
    successors, pair_keys, pair_successors, bits, fallback, starts, paths, depths, out
):  # pragma: no cover - compiled
    """`SuccessorTable.walk` on the arrays (`starts` and `depths`: one for all paths, or one a
    path): out[i, :lengths[i]] are path i's tokens."""
    count = paths.shape[0]
    lengths = np.zeros(count, np.int64)
    for i in range(count):
        start = i if starts.shape[0] > 1 else 0
        previous, token = starts[start, 0], starts[start, 1]
        for j in range(min(depths[i if depths.shape[0] > 1 else 0], paths.shape[1])):
            rank = paths[i, j]
            following = np.int64(-1)
            paired = False
            if bits > 0 and previous >= 0:
                bucket = _bucket_compiled(previous, token, bits)
                if pair_keys[bucket] == previous << 32 | token:
                    paired = True
                    if rank < pair_successors.shape[1]:
                        following = np.int64(pair_successors[bucket, rank])
            if not paired:
                if token < successors.shape[0] and successors[token, 0] >= 0:
                    if rank < successors.shape[1]:
                        following = np.int64(successors[token, rank])
                elif token < fallback.shape[0] and rank < fallback.shape[1]:
                    following = np.int64(fallback[token, rank])
            if following < 0:
                break
            out[i, j] = following
            lengths[i] = j + 1
            previous, token = token, following
    return lengths


def compile_table_kernels() -> None:
    """Compile (or load from numba's cache) `_refresh` and `_walk` for the arrays the engine
    and the strategies hand over, with pair rows and without, so that no request's first
    round waits for them (compiling takes seconds; docs/benchmarks.md)."""
    tokens, top = np.zeros(1, np.int64), np.zeros((1, 1), np.int64)
    table = SuccessorTable(top_k=1, pair_bits=1)
    table._grow(1)
    for parents in (tokens, None):
        _refresh(table.successors, tokens, top, parents, table.pair_keys, table.pair_successors, 1)
    table.walk([(-1, 0)], np.zeros((1, 1), dtype=np.int64), [1])


@lru_cache(maxsize=64)
def rank_paths(
    k: int, w: int, prior: tuple[float, ...] = RANK_PRIOR
) -> tuple[tuple[int, ...], ...]:
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
            for prefix in [(), *sorted(nodes)]
            if len(prefix) < w
            for rank in range(len(prior))
            if prefix + (rank,) not in nodes
        )
        best = max(branches, key=lambda path: _gain(path, nodes, prior), default=None)
        if best is None:
            break
        paths.append(best)
        nodes.update(best[:depth] for depth in range(1, w + 1))
    return tuple(paths)


@lru_cache(maxsize=64)
def _rank_path_array(k: int, w: int) -> np.ndarray:
    """`rank_paths(k, w)` as the [k, w] array `SuccessorTable.walk` takes."""
    paths = rank_paths(k, w)
    return np.array(paths, dtype=np.int64) if paths else np.zeros((0, 0), dtype=np.int64)


def _gain(path: tuple[int, ...], nodes: set[tuple[int, ...]], prior: tuple[float, ...]) -> float:
    """Expected accepted nodes `path` adds to the tree of `nodes`."""
    gain, chance = 0.0, 1.0
    for depth, rank in enumerate(path, start=1):  # plain floats: numpy's per-call overhead
        chance *= prior[rank]  # made building a large template several times slower
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
        paths = _rank_path_array(k, w)
        if not len(paths):
            return []
        previous = history.token_ids[-2] if len(history) > 1 else -1
        drafts: list[Draft] = []
        seen: set[tuple[int, ...]] = set()
        for rank, tokens in enumerate(self.table.walk([(previous, history.last_token)], paths)):
            if tokens and tokens not in seen:
                seen.add(tokens)
                drafts.append(Draft(tokens, self.name, rank))
        return drafts
