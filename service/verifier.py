"""Greedy verification of a token tree: keep the longest path the model agrees with.

Terms. The tree's root is the pending token p; every other node is a drafted token. The
model's greedy choice after node i is y_i = argmax(logits[i]). Starting at the root, if a
child of the current node carries y_current, that child is *accepted* and the walk moves to
it; otherwise the walk stops. The *bonus* token is y at the stopping node: the model's own
next token, free from the same pass. So a round commits m accepted tokens + 1 bonus token,
and the sequence committed is exactly what plain greedy decoding would produce (each accepted
token is the argmax given its full prefix, because the tree mask gave its node exactly that
prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """What one pass over a tree decided."""

    accepted_nodes: list[int]  # tree nodes on the accepted path, root excluded, in order
    accepted_token_ids: list[int]  # the tokens of those nodes
    bonus_token_id: int  # the model's choice after the last accepted node

    @property
    def token_ids(self) -> list[int]:
        """All tokens this round commits: accepted drafts then the bonus."""
        return [*self.accepted_token_ids, self.bonus_token_id]


def verify_greedy(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """Walk `tree` along the model's argmax; `logits` is [num_nodes, vocab] for this row."""
    choices: list[int] = logits[: tree.num_nodes].argmax(dim=-1).tolist()  # [num_nodes]
    node, path = 0, []
    while (child := tree.children[node].get(choices[node])) is not None:
        path.append(child)
        node = child
    return Verdict(
        accepted_nodes=path,
        accepted_token_ids=[tree.token_ids[i] for i in path],
        bonus_token_id=choices[node],
    )
