"""KV rows for a draft model, one per drafting request, all drafted in the same passes.

The draft runs through the target's own machinery (`ModelRunner` over a `TreeKVCache`), so
one draft pass serves every request that drafts this step: ragged rows, each its own tree.
A row holds the tokens the target has committed (its first `length` entries); a round of
drafting leaves on top of them, uncommitted, its *scratch tree*: the tokens the round fed
(what the row lacked of the history, the newest token last) and below the newest the drafted
branches, breadth-first, node i at `length + i`. Only nodes that were fed have entries (the
deepest drafted tokens never are).

Two kinds of rows:
- `DraftRows`: the draft's own cache (a separate draft model). `sync` lines a row up with its
  request's history before the next round: the scratch tree's path that the target
  committed keeps its entries (moved right after the committed ones, so neither the fed
  tokens nor an accepted draft is recomputed); the rest is forgotten (rollback after partial
  acceptance or rejection costs nothing).
- `TargetRows`: the target's own cache (a self-draft, the target's first m layers). The
  target's entries of those layers *are* the self-draft's, since it runs the same modules on
  the same tokens, so a self-draft needs no cache, no catch-up and no memory of its own: it
  feeds the pending token (and a last prompt chunk) and its tree as scratch past the target's
  committed entries, which the target's pass then overwrites.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drafting import TokenHistory, common_prefix
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner
from service.model.tree import TokenTree

RowOf = Callable[[TokenHistory], int]  # the target's KV row of a running request


@dataclass
class DraftRow:
    """One request's row: its index in the cache, the committed tokens it holds, its scratch."""

    index: int
    token_ids: list[int]  # committed tokens with entries at [0, len)
    scratch: TokenTree | None = None  # fed and drafted nodes after them (fed ones hold entries)


class DraftRows:
    """Rows of a draft model's own cache, keyed by the request's history."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache = runner.new_cache()
        self._rows: dict[int, tuple[TokenHistory, DraftRow]] = {}  # id(history) -> row

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    def row(self, history: TokenHistory) -> DraftRow:
        """The request's row, opened empty on its first round."""
        entry = self._rows.get(id(history))
        if entry is None:
            entry = self._rows[id(history)] = (history, DraftRow(self.cache.add_row(), []))
        return entry[1]

    def release(self, history: TokenHistory) -> None:
        """The request ended: free its row. The last row moves into the slot, its committed
        entries only: its scratch is forgotten (recomputed if the target accepted it)."""
        entry = self._rows.pop(id(history), None)
        if entry is None:
            return
        freed = entry[1].index
        moved = self.cache.remove_row(freed)
        if moved is not None:
            for _, other in self._rows.values():
                if other.index == moved:
                    other.index, other.scratch = freed, None

    def sync(self, row: DraftRow, history: Sequence[int]) -> list[int]:
        """Commit what the row holds of `history` (the scratch path the target committed
        included), forget the rest, and return the tokens still to feed (never empty)."""
        committed = common_prefix(row.token_ids, history)
        keep = min(committed, len(history) - 1)
        self.cache.lengths[row.index] = keep  # entries past it are forgotten, not moved
        if keep == len(row.token_ids) and row.scratch is not None:
            self.cache.commit(row.index, matching_path(row.scratch, history[keep:-1]))
        row.token_ids, row.scratch = list(history[: self.cache.lengths[row.index]]), None
        return list(history[len(row.token_ids) :])


class TargetRows:
    """The target's own KV rows, borrowed by a self-draft for the drafting part of each step
    (`bind` before drafting: the engine's cache and its row of each request)."""

    kv_bytes_per_token = 0  # it holds nothing of its own

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._cache: TreeKVCache | None = None
        self._row_of: RowOf | None = None

    def __len__(self) -> int:
        return 0

    def bind(self, cache: TreeKVCache, row_of: RowOf) -> None:
        self._cache, self._row_of = cache, row_of

    @property
    def cache(self) -> TreeKVCache:
        if self._cache is None:
            raise RuntimeError(
                "a self-draft sharing the target's cache drafts inside an engine step only"
            )
        return self._cache

    def row(self, history: TokenHistory) -> DraftRow:
        assert self._row_of is not None
        index = self._row_of(history)
        return DraftRow(index, list(history.token_ids[: self.cache.lengths[index]]))

    def release(self, history: TokenHistory) -> None:
        """Nothing is held per request."""

    def sync(self, row: DraftRow, history: Sequence[int]) -> list[int]:
        """The tokens the target's row lacks: the pending one (after a last prompt chunk)."""
        return list(history[len(row.token_ids) :])


def matching_path(tree: TokenTree, tokens: Sequence[int]) -> list[int]:
    """The nodes of `tree` spelling the longest prefix of `tokens` from its root down."""
    if not tokens or not tree.token_ids or tree.token_ids[0] != tokens[0]:
        return []
    path = [0]
    for token in tokens[1:]:
        child = tree.children[path[-1]].get(token)
        if child is None:
            break
        path.append(child)
    return path


def tree_of(tokens: Sequence[int], parents: Sequence[int]) -> TokenTree:
    """A breadth-first tree from its tokens and parents (node 0 the root)."""
    depths: list[int] = []
    children: list[dict[int, int]] = [{} for _ in tokens]
    for node, parent in enumerate(parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        if parent >= 0:
            children[parent][tokens[node]] = node
    return TokenTree(list(tokens), list(parents), depths, [None] * len(tokens), children)
