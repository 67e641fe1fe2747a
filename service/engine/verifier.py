"""Verification of a token tree: keep the longest path the model itself would have taken.

Terms. The tree's root is the pending token; every other node is a drafted token. After
each node i the model *chooses* a token y_i: its argmax when greedy, else a sample of its
target distribution p_i (see `sampling.py`). Starting at the root, if a child of the current
node carries y_current, that child is *accepted* and the walk moves on; otherwise the walk
stops and y at the stopping node is the *bonus* token. A round commits m accepted tokens
plus the bonus.

Why this is lossless. Every node's logits are those of its full prefix (the tree mask), so
y_i is exactly the token plain decoding would pick after that prefix. Greedy: the committed
tokens are plain greedy's. Sampling: drafts are deterministic (one-hot proposals), and the
rule "sample y ~ p at the node; descend into the child carrying y, else emit y" emits each
child x with probability p(x) and any other token with its own p — the law p itself (the
one-hot case of Leviathan et al.'s rule, applied per node as in SpecInfer's multi-draft
verification; siblings are distinct tokens, which the trie guarantees). With the per-
position uniforms of `sampling.py`, y_i is even the same token plain sampling would draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.params import SamplingParams
from service.engine.sampling import PositionUniforms, choose_tokens, greedy_choices
from service.grammar import Constraint
from service.model.tree import TokenTree


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

    @property
    def choosing_nodes(self) -> list[int]:
        """The node whose choice is each of `token_ids`: the root, then each accepted node."""
        return [0, *self.accepted_nodes]


def verify(
    tree: TokenTree,
    logits: torch.Tensor,
    sampling: SamplingParams,
    uniforms: PositionUniforms | None,
    first_position: int,
    greedy: list[int] | None = None,
    constraint: Constraint | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Verdict:
    """Walk `tree` along the model's choices; `logits` is [num_nodes, vocab] for this row.

    `first_position` is the output position the root's choice fills (the committed length);
    node i's choice fills `first_position + depth_i`. `greedy`: the nodes' argmax tokens when
    the caller took them already (with greedy `sampling`), for all rows of a pass at once.
    A `constraint` (structured output) makes the choices one node at a time (`_walk_constrained`).
    """
    if constraint is not None:
        return _walk_constrained(
            tree, logits, sampling, uniforms, first_position, constraint, stop_ids
        )
    if greedy is not None and sampling.greedy:
        choices = greedy[: tree.num_nodes]
    else:
        positions = [first_position + depth for depth in tree.depths]
        u = None if sampling.greedy or uniforms is None else uniforms.at(positions)
        choices = choose_tokens(logits[: tree.num_nodes], sampling, u)  # [num_nodes]
    node, path = 0, []
    while (child := tree.children[node].get(choices[node])) is not None:
        path.append(child)
        node = child
    return Verdict(
        accepted_nodes=path,
        accepted_token_ids=[tree.token_ids[i] for i in path],
        bonus_token_id=choices[node],
    )


def _walk_constrained(
    tree: TokenTree,
    logits: torch.Tensor,
    sampling: SamplingParams,
    uniforms: PositionUniforms | None,
    first_position: int,
    constraint: Constraint,
    stop_ids: frozenset[int],
) -> Verdict:
    """The walk under a grammar: each node's choice is the model's over the tokens the grammar
    allows after that node's path, so only the nodes the walk reaches need their mask, and the
    constraint advances by exactly the committed tokens. Plain decoding is the one-node case,
    so greedy output and seeded samples equal plain constrained decoding's. The walk ends at a
    stop token (the grammar has nothing after it)."""
    node, path = 0, []
    while True:
        choice = _constrained_choice(
            logits[node], sampling, uniforms, first_position + len(path), constraint
        )
        child = tree.children[node].get(choice)
        if child is None or choice in stop_ids:
            break
        path.append(child)
        node = child
    return Verdict(
        accepted_nodes=path,
        accepted_token_ids=[tree.token_ids[i] for i in path],
        bonus_token_id=choice,
    )


def _constrained_choice(
    logits: torch.Tensor,
    sampling: SamplingParams,
    uniforms: PositionUniforms | None,
    position: int,
    constraint: Constraint,
) -> int:
    """The model's choice at one node ([vocab] logits) among the tokens the grammar allows,
    accepted by the constraint. Greedy tries the unmasked argmax first: when the grammar allows
    it, it is the masked argmax too, and the mask is never computed."""
    if sampling.greedy:
        choice = greedy_choices(logits[None])[0]
        if constraint.accept(choice):
            return choice
    masked = constraint.masked(logits)
    if not torch.isfinite(masked).any():
        raise RuntimeError("the grammar allows no token here")
    u = None if sampling.greedy or uniforms is None else uniforms.at([position])
    choice = choose_tokens(masked[None], sampling, u)[0]
    if not constraint.accept(choice):
        raise RuntimeError(f"the grammar refused token {choice}, which its own mask allowed")
    return choice
