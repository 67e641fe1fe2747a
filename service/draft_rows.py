"""A draft model's KV rows: one per drafting request, all drafted in the same passes.

The draft runs through the target's own machinery (`ModelRunner` over a `TreeKVCache`), so
one draft pass serves every request that drafts this step: ragged rows, each its own tree.
A request's row holds the tokens the target has committed (`token_ids`); on top of them, after
a round of drafting, the *forest* it drafted sits uncommitted: the k first tokens (roots, each
a child of the newest committed token) and their continuations, in breadth-first order, node i
at `length + i`. Only nodes that were fed have entries (the deepest drafted tokens never are).

`sync` lines a row up with its request's history before the next round: a drafted path the
target committed keeps its entries (moved right after the committed ones, so an accepted draft
is never recomputed); the rest of the forest is simply forgotten (rollback after partial
acceptance or rejection costs nothing). What is left to feed is at least the newest token,
whose logits the next round starts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drafting import TokenHistory, common_prefix
from service.model_runner import ModelRunner
from service.tree import TokenTree


@dataclass
class DraftRow:
    """One request's row: its index in the cache, the committed tokens it holds, the forest."""

    index: int
    token_ids: list[int] = field(default_factory=list)  # committed tokens with entries at [0, len)
    forest_tokens: list[int] = field(default_factory=list)  # fed drafted nodes, breadth-first
    forest_parents: list[int] = field(default_factory=list)  # -1: a root (child of the newest committed)

    def forest(self) -> TokenTree:
        return forest_tree(self.forest_tokens, self.forest_parents)


class DraftRows:
    """Rows of one draft model's cache, keyed by the request's history."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache = runner.new_cache()
        self._rows: dict[int, tuple[TokenHistory, DraftRow]] = {}  # id(history) -> row

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, history: TokenHistory) -> DraftRow:
        """The request's row, opened empty on its first round."""
        entry = self._rows.get(id(history))
        if entry is None:
            entry = self._rows[id(history)] = (history, DraftRow(self.cache.add_row()))
        return entry[1]

    def release(self, history: TokenHistory) -> None:
        """The request ended: free its row. The last row moves into the slot, its committed
        entries only: its drafted forest is forgotten (recomputed if the target accepts it)."""
        entry = self._rows.pop(id(history), None)
        if entry is None:
            return
        freed = entry[1].index
        moved = self.cache.remove_row(freed)
        if moved is not None:
            for _, other in self._rows.values():
                if other.index == moved:
                    other.index = freed
                    other.forest_tokens, other.forest_parents = [], []

    def sync(self, row: DraftRow, history: Sequence[int]) -> list[int]:
        """Commit what the row holds of `history` (a drafted path included), forget the rest,
        and return the tokens still to feed (never empty)."""
        committed = common_prefix(row.token_ids, history)
        path: list[int] = []
        if committed == len(row.token_ids):  # the forest continues exactly these tokens
            path = _matching_path(row.forest_tokens, row.forest_parents, history[committed:-1])
        keep = min(committed, len(history) - 1)
        self.cache.lengths[row.index] = keep  # entries past it are forgotten, not moved
        if path and keep == committed:
            self.cache.commit(row.index, path)
        row.token_ids = list(history[: self.cache.lengths[row.index]])
        row.forest_tokens, row.forest_parents = [], []
        return list(history[len(row.token_ids) :])

    def commit_fed(self, row: DraftRow, fed: Sequence[int]) -> None:
        """After the pass that fed them: `fed` (committed tokens) join the row's prefix."""
        self.cache.commit(row.index, range(len(fed)))
        row.token_ids.extend(fed)


def forest_tree(tokens: Sequence[int], parents: Sequence[int]) -> TokenTree:
    """A breadth-first forest whose roots (parent -1) are children of the committed prefix."""
    depths: list[int] = []
    children: list[dict[int, int]] = [{} for _ in tokens]
    for node, parent in enumerate(parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        if parent >= 0:
            children[parent][tokens[node]] = node
    return TokenTree(list(tokens), list(parents), depths, [None] * len(tokens), children)


def _matching_path(tokens: Sequence[int], parents: Sequence[int], new: Sequence[int]) -> list[int]:
    """The forest nodes spelling the longest prefix of `new` from a root down."""
    path: list[int] = []
    for token in new:
        parent = path[-1] if path else -1
        node = next((n for n in range(len(tokens)) if parents[n] == parent and tokens[n] == token), None)
        if node is None:
            break
        path.append(node)
    return path
