"""The tree every row of a device round drafts into: one fixed shape, so a round is tensors of
fixed sizes (a CUDA graph's condition) and the host never builds a tree.

Node 0 is the root (the pending token). Nodes 1..`chain` are the context draft, a chain.
The rest is the successor tables' trie: the static rank-path template of k paths of w ranks
(`drafting.rank_paths`), each node the `rank`-th successor of its parent's token. A parent
always precedes its children. Nodes a row cannot fill (the context had no match, a table row
ran out) stay in the pass but can never be accepted (`DeviceDrafts.valid`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch

from drafting import rank_paths
from service.model.tree import TokenTree


@dataclass(frozen=True)
class TreeTemplate:
    """A draft tree's shape shared by all rows of a round."""

    parents: tuple[int, ...]  # [N]; the root's is -1
    depths: tuple[int, ...]  # [N]
    # [N]: a table node's rank among its parent's successors; -1 for the root and chain nodes
    ranks: tuple[int, ...]
    chain: int  # context nodes, 1..chain
    k: int
    w: int
    _tensors: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, k: int, w: int, chain: int = 0) -> TreeTemplate:
        return _template(k, w, chain)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def shape_tree(self) -> TokenTree:
        """The template as a `TokenTree` whose tokens are placeholders: what the pass's layout
        needs (parents, depths), the tokens coming from the device."""
        n = self.num_nodes
        return TokenTree(
            token_ids=[0] * n,
            parents=list(self.parents),
            depths=list(self.depths),
            strategies=[None] * n,
            children=[{} for _ in range(n)],
        )

    def tensors(self, device: torch.device) -> TemplateTensors:
        """The template's index tensors on `device` (made once per device)."""
        made = self._tensors.get(device)
        if made is None:
            made = self._tensors[device] = TemplateTensors.of(self, device)
        return made


@dataclass(frozen=True)
class TableLevel:
    """The table nodes at one depth, as the walk reads them: their indices, their parents', the
    columns of their grandparents' tokens (in the walk's [previous, node tokens...] array, so
    column 0 is the root's previous token) and their ranks."""

    nodes: torch.Tensor  # int64 [n]
    parents: torch.Tensor  # int64 [n]
    grandparent_columns: torch.Tensor  # int64 [n]
    ranks: torch.Tensor  # int64 [n]


@dataclass(frozen=True)
class TemplateTensors:
    """A template on a device: parents (the root its own parent), depths, the ancestor
    matrix, and the table nodes by depth (the walk fills one depth a gather)."""

    parents: torch.Tensor  # int64 [N]
    depths: torch.Tensor  # int64 [N]
    ancestors: torch.Tensor  # bool [N, N]: j is i or one of i's ancestors
    table_levels: tuple[TableLevel, ...]  # the table nodes at depth 1, 2, ...

    @classmethod
    def of(cls, template: TreeTemplate, device: torch.device) -> TemplateTensors:
        n = template.num_nodes
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for node, parent in enumerate(template.parents):
            if parent >= 0:
                ancestors[node] = ancestors[parent]
            ancestors[node, node] = True
        levels = []
        for depth in range(1, template.max_depth + 1):
            nodes = [i for i in range(n) if template.ranks[i] >= 0 and template.depths[i] == depth]
            if nodes:
                parents = [template.parents[i] for i in nodes]
                levels.append(
                    TableLevel(
                        *(
                            torch.tensor(values, dtype=torch.long, device=device)
                            for values in (
                                nodes,
                                parents,
                                [0 if p == 0 else template.parents[p] + 1 for p in parents],
                                [template.ranks[i] for i in nodes],
                            )
                        )
                    )
                )
        return cls(
            parents=torch.tensor(
                [max(p, 0) for p in template.parents], dtype=torch.long, device=device
            ),
            depths=torch.tensor(template.depths, dtype=torch.long, device=device),
            ancestors=ancestors.to(device),
            table_levels=tuple(levels),
        )


@lru_cache(maxsize=64)
def _template(k: int, w: int, chain: int) -> TreeTemplate:
    parents, depths, ranks = [-1], [0], [-1]
    for depth in range(1, chain + 1):  # the context chain
        parents.append(depth - 1)
        depths.append(depth)
        ranks.append(-1)
    # the rank-path trie, breadth first: every prefix of every path a node
    prefixes = sorted(
        {path[:d] for path in rank_paths(k, w) for d in range(1, len(path) + 1)},
        key=lambda p: (len(p), _first_seen(p, rank_paths(k, w))),
    )
    index = {(): 0}
    for prefix in prefixes:
        index[prefix] = len(parents)
        parents.append(index[prefix[:-1]])
        depths.append(len(prefix))
        ranks.append(prefix[-1])
    return TreeTemplate(tuple(parents), tuple(depths), tuple(ranks), chain, k, w)


def _first_seen(prefix: tuple[int, ...], paths: tuple[tuple[int, ...], ...]) -> int:
    """The index of the first path through `prefix` (its draft's rank): better drafts' nodes
    first."""
    return next(i for i, path in enumerate(paths) if path[: len(prefix)] == prefix)
