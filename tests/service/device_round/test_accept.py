"""Batched greedy acceptance commits what the host's node-by-node walk commits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafting import Draft
from service.device_round.accept import accept_greedy
from service.device_round.template import TreeTemplate
from service.engine.params import SamplingParams
from service.engine.verifier import verify
from service.model.tree import build_tree

VOCAB = 6  # few tokens: drafts often hold the model's choice


@pytest.mark.parametrize("k,w,chain", [(4, 4, 0), (8, 8, 8), (2, 3, 3), (0, 5, 5)])
def test_acceptance_equals_the_host_walk(k: int, w: int, chain: int) -> None:
    rng = np.random.default_rng(k + w + chain)
    template = TreeTemplate.of(k, w, chain)
    shape = template.tensors(torch.device("cpu"))
    rows, n = 32, template.num_nodes
    tokens = torch.from_numpy(rng.integers(0, VOCAB, (rows, n)))
    valid = torch.from_numpy(rng.random((rows, n)) < 0.9)
    valid[:, 0] = True
    for node, parent in enumerate(template.parents):  # a node is filled only below a filled parent
        if parent >= 0:
            valid[:, node] &= valid[:, parent]
    # the model's choice after a node depends on its path alone (a context node and a table
    # node holding the same path see the same logits)
    choice_of: dict[tuple[int, ...], int] = {}
    paths = [_template_paths(template, tokens[row].tolist()) for row in range(rows)]
    choices = torch.tensor(
        [
            [choice_of.setdefault(path, int(rng.integers(0, VOCAB))) for path in row_paths]
            for row_paths in paths
        ]
    )
    accepted = accept_greedy(tokens, valid, choices, shape, template.max_depth)
    for row in range(rows):
        filled = [paths[row][node][1:] for node in range(1, n) if valid[row, node]]
        tree = build_tree(int(tokens[row, 0]), [Draft(path, "x") for path in dict.fromkeys(filled)])
        logits = torch.full((tree.num_nodes, VOCAB), -1.0)
        for node in range(tree.num_nodes):  # one-hot at the node's choice
            logits[node, choice_of[(int(tokens[row, 0]),) + _path(tree, node)]] = 1.0
        verdict = verify(tree, logits, SamplingParams(temperature=0), None, first_position=0)
        count = int(accepted.counts[row])
        assert accepted.tokens[row, : count + 1].tolist() == verdict.token_ids
        assert [paths[row][node] for node in accepted.path[row, 1 : count + 1].tolist()] == [
            (int(tokens[row, 0]),) + _path(tree, node) for node in verdict.accepted_nodes
        ]


def _template_paths(template: TreeTemplate, tokens: list[int]) -> list[tuple[int, ...]]:
    """Each template node's token path, the root's token first."""
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(template.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tokens[node],))
    return paths


def _path(tree, node: int) -> tuple[int, ...]:
    path = []
    while node > 0:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return tuple(reversed(path))


def test_path_lists_the_accepted_nodes_by_depth() -> None:
    template = TreeTemplate.of(0, 3, 3)  # a chain: nodes 1, 2, 3
    shape = template.tensors(torch.device("cpu"))
    tokens = torch.tensor([[9, 4, 5, 6], [9, 4, 5, 6]])
    choices = torch.tensor([[4, 5, 1, 2], [4, 5, 6, 7]])
    accepted = accept_greedy(tokens, torch.ones_like(tokens, dtype=torch.bool), choices, shape, 3)
    assert accepted.counts.tolist() == [2, 3]
    assert accepted.path.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert accepted.tokens[0, :3].tolist() == [4, 5, 1] and accepted.tokens[1].tolist() == [
        4,
        5,
        6,
        7,
    ]
