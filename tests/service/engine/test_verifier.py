"""Verification of a token tree (`service/engine/verifier.py`) on literal trees and logits: the
greedy walk keeps the path the model's argmax takes, and the sampling walk emits each token
with the target probability — the very token plain sampling draws at that position."""

from __future__ import annotations

import pytest
import torch

from drafting import Draft
from service.engine.params import SamplingParams
from service.engine.sampling import PositionUniforms
from service.engine.verifier import verify
from service.model.tree import TokenTree, build_tree

VOCAB = 16
ROOT = 7
# node paths below the root: 3-4-5 and 3-4-6 share two nodes; 8 and 3-9 branch off
TREE = build_tree(
    ROOT, [Draft((3, 4, 5), "a"), Draft((3, 4, 6), "a"), Draft((8,), "b"), Draft((3, 9), "b")]
)
GREEDY = SamplingParams()


def node_at(tree: TokenTree, path: tuple[int, ...]) -> int:
    node = 0
    for token in path:
        node = tree.children[node][token]
    return node


def logits_choosing(
    tree: TokenTree, choices: dict[tuple[int, ...], int], default: int = 0
) -> torch.Tensor:
    """[nodes, VOCAB] logits whose argmax after the node at each path is `choices[path]`."""
    logits = torch.zeros(tree.num_nodes, VOCAB)
    logits[:, default] = 1.0
    for path, token in choices.items():
        logits[node_at(tree, path), token] = 2.0
    return logits


@pytest.mark.parametrize(
    "choices, accepted, bonus",
    [
        # the model agrees with 3-4-5 all the way: every node kept, the bonus chosen after the last
        ({(): 3, (3,): 4, (3, 4): 5, (3, 4, 5): 11}, [3, 4, 5], 11),
        # a mismatch at the root: nothing accepted, the root's choice is the round's one token
        ({(): 12}, [], 12),
        # among the root's children (3 and 8) the model picks 8
        ({(): 8, (8,): 1}, [8], 1),
        # below 3 the model takes the sibling 9, not 4
        ({(): 3, (3,): 9, (3, 9): 2}, [3, 9], 2),
        # below 3-4 it takes 6, the second of the two leaves
        ({(): 3, (3,): 4, (3, 4): 6, (3, 4, 6): 13}, [3, 4, 6], 13),
        # a drafted token the model does not choose stops the walk inside the tree
        ({(): 3, (3,): 4, (3, 4): 14}, [3, 4], 14),
    ],
)
def test_greedy_walk_keeps_the_argmax_path(
    choices: dict[tuple[int, ...], int], accepted: list[int], bonus: int
) -> None:
    verdict = verify(TREE, logits_choosing(TREE, choices), GREEDY, None, first_position=5)
    assert verdict.accepted_token_ids == accepted and verdict.bonus_token_id == bonus
    assert verdict.token_ids == [*accepted, bonus]
    assert verdict.accepted_nodes == [
        node_at(TREE, tuple(accepted[: i + 1])) for i in range(len(accepted))
    ]
    assert verdict.choosing_nodes == [0, *verdict.accepted_nodes]


def test_greedy_choices_given_replace_the_logits_and_only_when_greedy() -> None:
    """The caller's argmax of every node (taken for a whole pass at once) decides a greedy walk;
    a sampling walk ignores it."""
    logits = logits_choosing(TREE, {(): 12})  # alone, these stop at the root
    given = [0] * TREE.num_nodes
    given[0], given[node_at(TREE, (8,))] = 8, 1
    assert verify(TREE, logits, GREEDY, None, 0, greedy=given).token_ids == [8, 1]
    sampled = verify(
        TREE, logits * 100, SamplingParams(temperature=1.0), PositionUniforms(0), 0, greedy=given
    )
    assert sampled.token_ids == [12]  # the logits' near-certain choice, not the one given


def test_the_greedy_walk_reads_only_the_trees_rows() -> None:
    """Logits may carry rows past the tree (a padded pass): they are never read."""
    logits = torch.cat(
        [logits_choosing(TREE, {(): 8, (8,): 1}), torch.full((3, VOCAB), float("nan"))]
    )
    assert verify(TREE, logits, GREEDY, None, 0).token_ids == [8, 1]


# Target distributions of the sampling tests: the root's, and the one after the drafted node 1.
P_ROOT = torch.tensor([0.05, 0.30, 0.15, 0.50])
P_AFTER_1 = torch.tensor([0.40, 0.10, 0.20, 0.30])
SMALL_TREE = build_tree(
    0, [Draft((1, 2), "a"), Draft((3,), "a")]
)  # root 0; children 1 (then 2) and 3
SAMPLE = SamplingParams(temperature=1.0, seed=0)


def small_tree_logits() -> torch.Tensor:
    logits = torch.full((SMALL_TREE.num_nodes, 4), -1.0).log_softmax(
        -1
    )  # uniform after the other nodes
    logits[0] = P_ROOT.log()
    logits[node_at(SMALL_TREE, (1,))] = P_AFTER_1.log()
    return logits


def inverse_cdf(p: torch.Tensor, u: float) -> int:
    """The token plain sampling draws from p with the uniform u: the first whose cumulative mass
    reaches u (of the total, as float32 sums it)."""
    cdf = p.log().softmax(-1).cumsum(-1).tolist()
    return next(token for token, mass in enumerate(cdf) if mass >= u * cdf[-1])


def test_sampled_tokens_are_plain_samplings_at_each_position() -> None:
    """With the request's uniforms, the first token is F⁻¹_p(u_t) of the root's distribution at
    position t, and after an accepted node 1 the next is F⁻¹(u_{t+1}) of the node's: the same
    tokens plain decoding would sample, position by position."""
    uniforms, logits = PositionUniforms(seed=3), small_tree_logits()
    for t in range(200):
        verdict = verify(SMALL_TREE, logits, SAMPLE, uniforms, first_position=t)
        u = uniforms.at([t, t + 1]).tolist()
        first = inverse_cdf(P_ROOT, u[0])
        assert verdict.token_ids[0] == first
        if first == 1:  # accepted: the node's own distribution chose the next token
            assert verdict.token_ids[1] == inverse_cdf(P_AFTER_1, u[1])
        elif first == 3:  # accepted leaf: the bonus comes from its (uniform) distribution
            assert len(verdict.token_ids) == 2
        else:  # not drafted: the walk stops at the root
            assert verdict.token_ids == [first] and verdict.accepted_nodes == []


class FixedUniforms(PositionUniforms):
    """The uniforms the test chooses, by position (0.5 where it chose none)."""

    def __init__(self, values: dict[int, float]) -> None:
        super().__init__(seed=0)
        self.values = values

    def at(self, positions: list[int]) -> torch.Tensor:
        return torch.tensor([self.values.get(p, 0.5) for p in positions], dtype=torch.float64)


def test_the_emitted_law_is_exactly_the_target_distribution() -> None:
    """u swept over the midpoints of 200 equal bins: each token is emitted for exactly its
    probability's share of them (the masses are multiples of 1/200, so no bin straddles two
    tokens). The root's law is p_root, drafted children (1, 3) or not (0, 2) alike; after an
    accepted 1, the next token's law is p_after_1, whatever the draft below it (2) says."""
    bins = 200
    grid = [(i + 0.5) / bins for i in range(bins)]
    logits = small_tree_logits()

    def emitted(uniforms: dict[int, float], index: int) -> int:
        return verify(
            SMALL_TREE, logits, SAMPLE, FixedUniforms(uniforms), first_position=0
        ).token_ids[index]

    first = torch.bincount(torch.tensor([emitted({0: u}, 0) for u in grid]), minlength=4)
    assert first.tolist() == (P_ROOT * bins).round().long().tolist()
    after_1 = torch.bincount(
        torch.tensor([emitted({0: 0.2, 1: u}, 1) for u in grid]), minlength=4
    )  # u_0 = 0.2: a 1
    assert after_1.tolist() == (P_AFTER_1 * bins).round().long().tolist()
