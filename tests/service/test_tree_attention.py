"""A tree pass must give each node the logits of decoding its path token by token."""

from __future__ import annotations

import pytest
import torch

from drafting import Draft
from service.model_runner import ModelRunner
from service.tree import build_tree, chain_tree
from tests.conftest import make_tiny_model

PROMPT = [5, 9, 13, 2, 7, 7, 30, 41]
DRAFTS = [
    Draft((3, 4, 5), "context"),
    Draft((3, 4, 6), "context"),  # shares two nodes with the first
    Draft((8,), "context"),
    Draft((3, 9, 10, 11), "context"),
]


def sequential_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Reference: a plain causal forward over the whole sequence, logits of the last token."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0, -1]


def prefilled(runner: ModelRunner, prompt: list[int]):
    """A cache holding `prompt` minus its last (pending) token."""
    cache = runner.new_cache()
    prefix = chain_tree(prompt[:-1])
    runner.forward(cache, [prefix], logits=False)
    cache.commit(0, range(prefix.num_nodes))
    return cache


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_tree_node_logits_equal_sequential_decoding(attn_implementation: str) -> None:
    model = make_tiny_model(seed=1, attn_implementation=attn_implementation)
    runner = ModelRunner(model)
    cache = prefilled(runner, PROMPT)

    tree = build_tree(PROMPT[-1], DRAFTS)
    logits = runner.forward(cache, [tree])[0]  # [num_nodes, vocab]

    for node in range(tree.num_nodes):
        path, cursor = [], node
        while cursor > 0:
            path.append(tree.token_ids[cursor])
            cursor = tree.parents[cursor]
        expected = sequential_logits(model, PROMPT + path[::-1])
        torch.testing.assert_close(logits[node], expected, atol=1e-5, rtol=1e-5)


def test_compacted_cache_continues_like_a_fresh_decode() -> None:
    """After keeping one branch, the next pass sees exactly prompt + that branch."""
    model = make_tiny_model(seed=2)
    runner = ModelRunner(model)
    cache = prefilled(runner, PROMPT)
    tree = build_tree(PROMPT[-1], DRAFTS)
    runner.forward(cache, [tree])
    branch = [0, tree.children[0][3], tree.children[tree.children[0][3]][9]]  # root, 3, 9
    cache.commit(0, branch)
    assert cache.lengths == [len(PROMPT) + 2]

    logits = runner.forward(cache, [chain_tree([10])])[0, 0]
    torch.testing.assert_close(logits, sequential_logits(model, PROMPT + [3, 9, 10]), atol=1e-5, rtol=1e-5)
