"""Trie construction, BFS numbering and the ancestor mask on hand-made drafts."""

from __future__ import annotations

import torch

from drafting import Draft
from service.model.tree import build_tree, chain_tree


def test_shared_prefixes_are_stored_once_in_bfs_order() -> None:
    tree = build_tree(9, [Draft((1, 2, 3), "a"), Draft((1, 2, 4), "b"), Draft((5,), "c")])
    # root 9; depth 1: 1, 5; depth 2: 2; depth 3: 3, 4
    assert tree.token_ids == [9, 1, 5, 2, 3, 4]
    assert tree.parents == [-1, 0, 0, 1, 3, 3]
    assert tree.depths == [0, 1, 1, 2, 3, 3]
    assert tree.strategies == [None, "a", "c", "a", "a", "b"]
    assert tree.children[0] == {1: 1, 5: 2} and tree.children[3] == {3: 4, 4: 5}


def test_ancestor_mask_lets_a_node_see_only_its_path() -> None:
    tree = build_tree(9, [Draft((1, 2), "a"), Draft((5,), "a")])  # 9 -> 1 -> 2, 9 -> 5
    expected = torch.tensor(
        [
            [1, 0, 0, 0],  # root
            [1, 1, 0, 0],  # 1
            [1, 0, 1, 0],  # 5
            [1, 1, 0, 1],  # 2 (child of 1)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(torch.from_numpy(tree.ancestor_mask()), expected)


def test_node_cap_keeps_the_first_drafts() -> None:
    tree = build_tree(0, [Draft((1, 2), "a"), Draft((3, 4), "b")], max_nodes=4)
    assert tree.token_ids == [0, 1, 3, 2]


def test_no_drafts_is_the_plain_decoding_tree() -> None:
    tree = build_tree(7, [])
    assert tree.token_ids == [7] and tree.children == [{}]


def test_chain_is_causal() -> None:
    chain = chain_tree([4, 4, 6])
    assert torch.equal(
        torch.from_numpy(chain.ancestor_mask()), torch.tril(torch.ones(3, 3, dtype=torch.bool))
    )
    assert chain.depths == [0, 1, 2]
