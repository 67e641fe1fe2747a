"""References for a pass over a token tree: the logits of decoding each node's path token by
token, and a cache prefilled with prompts the way the engine leaves it."""

from __future__ import annotations

import torch

from drafting import Draft
from service.bench.near_ties import next_token_logits, reference_of
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner, RowInput
from service.model.tree import TokenTree, chain_tree

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
        return model(torch.tensor([token_ids], device=model.device)).logits[0, -1]


def prefilled(runner: ModelRunner, prompts: list[list[int]]) -> TreeKVCache:
    """A cache with one row per prompt, holding the prompt minus its last (pending) token."""
    cache = runner.new_cache()
    for _ in prompts:
        cache.add_row()
    chains = [chain_tree(prompt[:-1]) for prompt in prompts]
    runner.forward(cache, [RowInput(chain, chain.num_nodes) for chain in chains])
    for row, chain in enumerate(chains):
        cache.commit(row, range(chain.num_nodes))
    return cache


def path_to(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return path[::-1]


def assert_nodes_match(
    model, prompt: list[int], tree: TokenTree, logits: torch.Tensor, tolerance: float = 1e-5
) -> None:
    for node in range(tree.num_nodes):
        expected = sequential_logits(model, prompt + path_to(tree, node))
        torch.testing.assert_close(logits[node], expected, atol=tolerance, rtol=tolerance)


def assert_nodes_within_rounding(
    model, prompt: list[int], tree: TokenTree, logits: torch.Tensor
) -> None:
    """`assert_nodes_match` for a model whose dtype rounds (bf16): each node's logits within
    twice the served dtype's own deviation from the truth (a higher-precision pass from the same
    weights) of decoding that node's path token by token — the rule of service/bench/near_ties.py
    applied to whole logit vectors."""
    reference = reference_of(model)
    for node in range(tree.num_nodes):
        path = prompt + path_to(tree, node)
        truth = next_token_logits(reference, path).double()
        rounding = (sequential_logits(model, path).double() - truth).abs().max()
        error = (logits[node].double() - truth).abs().max()
        assert error <= 2 * rounding, (
            f"node {node}: {float(error):.4g} off the truth, rounding {float(rounding):.4g}"
        )
