"""The device table follows the host table's rules: the same passes give the same rows, and
the same walks the same drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafting import (
    ModelTables,
    PassDistributions,
    Recycled,
    SuccessorTable,
    TableSlot,
    TokenHistory,
)
from service.device_round.drafts import draft_trees
from service.device_round.tables import DeviceTable, last_writers
from service.device_round.template import TreeTemplate
from service.model.tree import build_tree

VOCAB = 40


def _random_pass(rng: np.random.Generator, nodes: int, k: int) -> PassDistributions:
    """A pass over a small vocabulary (tokens and pairs repeat, buckets collide)."""
    tokens = rng.integers(0, VOCAB, nodes)
    parents = rng.integers(-1, VOCAB, nodes)
    top = np.stack([rng.permutation(VOCAB)[:k] for _ in range(nodes)])
    return PassDistributions(tokens, top, 0, parents)


def _refresh_both(host: SuccessorTable, device: DeviceTable, passed: PassDistributions) -> None:
    host.observe(passed)
    device.refresh(
        torch.from_numpy(passed.node_tokens),
        torch.from_numpy(passed.parent_tokens),
        torch.from_numpy(passed.top_ids),
        torch.ones(len(passed.node_tokens), dtype=torch.bool),
    )


@pytest.mark.parametrize("pair_bits", [0, 3, 16])
def test_refresh_on_device_equals_the_host_refresh(pair_bits: int) -> None:
    rng = np.random.default_rng(pair_bits)
    host = SuccessorTable(top_k=4, pair_bits=pair_bits)
    device = DeviceTable(host, VOCAB, torch.device("cpu"))
    for _ in range(20):
        _refresh_both(host, device, _random_pass(rng, int(rng.integers(1, 30)), 4))
    successors, keys, pair_successors = device.host_view()
    rows = len(host.successors[:VOCAB])
    assert np.array_equal(successors[:rows].numpy(), host.successors[:rows])
    assert (successors[rows:] == -1).all()
    assert np.array_equal(keys.numpy(), host.pair_keys)
    assert np.array_equal(pair_successors.numpy(), host.pair_successors)


def test_nodes_not_kept_do_not_write() -> None:
    host = SuccessorTable(top_k=2)
    device = DeviceTable(host, VOCAB, torch.device("cpu"))
    device.refresh(
        torch.tensor([3, 3]),
        torch.tensor([-1, -1]),
        torch.tensor([[5, 6], [7, 8]]),
        torch.tensor([True, False]),
    )
    assert device.successors[3].tolist() == [
        5,
        6,
    ]  # the later node was not kept: the earlier one's row stays


def _paths(tree) -> set[tuple[int, ...]]:
    """Every node's token path from the root."""
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tree.token_ids[node],))
    return set(paths)


@pytest.mark.parametrize("k,w", [(1, 1), (4, 4), (8, 8), (3, 6)])
@pytest.mark.parametrize("pair_bits,fallback", [(0, False), (16, True), (3, True)])
def test_walks_draft_the_host_trees(k: int, w: int, pair_bits: int, fallback: bool) -> None:
    """The template filled on the device holds exactly the nodes of the host's tree of
    `Recycled.propose` (drafts merged into a trie), for histories over tables half learned."""
    rng = np.random.default_rng(k * 100 + w)
    bigram = np.stack([rng.permutation(VOCAB)[:6] for _ in range(VOCAB)]).astype(np.uint32)
    slot = TableSlot(ModelTables(np.arange(5), bigram) if fallback else None)
    host = SuccessorTable(top_k=4, fallback=slot, pair_bits=pair_bits)
    device = DeviceTable(host, VOCAB, torch.device("cpu"))
    for _ in range(6):
        _refresh_both(host, device, _random_pass(rng, 12, 4))
    device.sync_fallback()  # the round takes the model bigram before it drafts
    template = TreeTemplate.of(k, w)
    for _ in range(10):
        history = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 4)))]
        tokens, valid = draft_trees(torch.tensor([[-1, -1, *history][-2:]]), template, device)
        filled: dict[int, tuple[int, ...]] = {}  # node -> its token path
        for node, (parent, token) in enumerate(zip(template.parents, tokens[0].tolist())):
            if valid[0, node]:
                filled[node] = (filled[parent] if parent >= 0 else ()) + (token,)
        host_tree = build_tree(history[-1], Recycled(host).propose(TokenHistory(history), k, w))
        assert set(filled.values()) == _paths(host_tree)
        assert len(filled) == host_tree.num_nodes  # siblings are distinct: no path twice


def test_each_slot_keeps_its_last_writer_only() -> None:
    """The rule the refresh relies on where a device applies repeated writes in any order (a
    CPU applies them in order, so the table comparisons above would not see it broken)."""
    slots = torch.tensor([3, 1, 3, 0, 1, 3, 2])
    writing = torch.tensor([True, True, True, True, False, False, True])
    assert last_writers(slots, writing, 5).tolist() == [False, True, True, True, False, False, True]
