"""Merge k drafts into one token tree and describe it for a single forward pass.

The root is the pending token p (the newest committed token, not yet in the cache). Each
draft is a path below the root; drafts that share a prefix share its nodes, so a trie of
at most 1 + k·w nodes comes out. Nodes are numbered in BFS order: a parent always precedes
its children, so the first `depth+1` entries of any accepted path are already ordered for
the cache compaction.

A plain decode step is the one-node tree (the root alone); a prompt prefill is a chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from drafting import Draft


@dataclass(frozen=True)
class TokenTree:
    """A flattened trie. Node 0 is the root; `parents[0] == -1`."""

    token_ids: list[int]  # [num_nodes]
    parents: list[int]  # [num_nodes]
    depths: list[int]  # [num_nodes]
    strategies: list[str | None]  # [num_nodes]: strategy of the draft that created the node
    children: list[dict[int, int]] = field(repr=False)  # node -> {token id: child node}

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def ancestor_mask(self) -> np.ndarray:
        """[num_nodes, num_nodes] bool: node i may attend to node j (j is i or an ancestor).
        numpy: a pass lays every row's mask out in one array (`service/model/attention.py`)."""
        mask = np.zeros((self.num_nodes, self.num_nodes), dtype=bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                mask[node] = mask[parent]
            mask[node, node] = True
        return mask


def build_tree(root_token: int, drafts: Sequence[Draft], max_nodes: int | None = None) -> TokenTree:
    """Merge `drafts` (continuations of `root_token`) into a BFS-ordered trie.

    `max_nodes` (root included) caps the tree; drafts are taken in order, so the best ones
    survive a cap.
    """
    if not drafts:  # a plain decoding row, every step: the root alone
        return chain_tree((root_token,))
    # Build the trie in insertion order, then renumber breadth-first.
    tokens, parents, strategies = [root_token], [-1], [None]
    kids: list[dict[int, int]] = [{}]
    for draft in drafts:
        node = 0
        for token in draft.token_ids:
            if token not in kids[node]:
                if max_nodes is not None and len(tokens) >= max_nodes:
                    break
                kids[node][token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                strategies.append(draft.strategy)
                kids.append({})
            node = kids[node][token]
    order = _breadth_first(kids)
    new_index = {old: new for new, old in enumerate(order)}
    depths = [0] * len(order)
    for new, old in enumerate(order[1:], start=1):
        depths[new] = depths[new_index[parents[old]]] + 1
    return TokenTree(
        token_ids=[tokens[old] for old in order],
        parents=[new_index[parents[old]] if parents[old] >= 0 else -1 for old in order],
        depths=depths,
        strategies=[strategies[old] for old in order],
        children=[{t: new_index[c] for t, c in kids[old].items()} for old in order],
    )


def chain_tree(token_ids: Sequence[int]) -> TokenTree:
    """A single path (e.g. a prompt prefill): node i is token i at depth i."""
    n = len(token_ids)
    return TokenTree(
        token_ids=list(token_ids),
        parents=list(range(-1, n - 1)),
        depths=list(range(n)),
        strategies=[None] * n,
        children=[{token_ids[i + 1]: i + 1} for i in range(n - 1)] + [{}] * min(n, 1),
    )


def prepend_chain(chain_ids: Sequence[int], tree: TokenTree) -> TokenTree:
    """`chain_ids` followed by `tree` (its root the chain's child): the last chunk of a prompt
    prefill and the request's first speculation tree, in one row of one pass. Node
    `len(chain_ids)` is the tree's root."""
    if not chain_ids:
        return tree
    chain, c = chain_tree(chain_ids), len(chain_ids)
    return TokenTree(
        token_ids=chain.token_ids + tree.token_ids,
        parents=chain.parents + [p + c if p >= 0 else c - 1 for p in tree.parents],
        depths=chain.depths + [d + c for d in tree.depths],
        strategies=chain.strategies + tree.strategies,
        children=chain.children[:-1]
        + [{tree.token_ids[0]: c}]
        + [{t: n + c for t, n in kids.items()} for kids in tree.children],
    )


def _breadth_first(kids: list[dict[int, int]]) -> list[int]:
    order, frontier = [0], [0]
    while frontier:
        frontier = [child for node in frontier for child in kids[node].values()]
        order.extend(frontier)
    return order
