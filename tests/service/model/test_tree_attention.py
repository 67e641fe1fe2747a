"""A pass must give each tree node the logits of decoding its path token by token — alone,
and with other rows of other lengths and widths in the same flat pass."""

from __future__ import annotations

import pytest
import torch

from drafting import Draft
from service.model.attention import batched_width, build_layout
from service.model.runner import ModelRunner, RowInput
from service.model.tree import TokenTree, build_tree, chain_tree, prepend_chain
from tests.helpers.models import make_tiny_model
from tests.helpers.passes import (
    DRAFTS,
    PROMPT,
    assert_nodes_match,
    path_to,
    prefilled,
    sequential_logits,
)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_tree_node_logits_equal_sequential_decoding(attn_implementation: str) -> None:
    model = make_tiny_model(seed=1, attn_implementation=attn_implementation)
    runner = ModelRunner(model)
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    logits = runner.forward(cache, [RowInput(tree)])[0]  # [num_nodes, vocab]
    assert_nodes_match(model, PROMPT, tree, logits)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_the_models_own_calls_on_a_cache_stay_causal_once_served(attn_implementation: str) -> None:
    """transformers' own forward of several new tokens on top of its cache (what its `generate`
    with prompt lookup runs) on a model a runner serves: the logits of the whole sequence."""
    model = make_tiny_model(seed=1, attn_implementation=attn_implementation)
    ModelRunner(model)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT], device=model.device)
        cache = model(ids[:, :5], use_cache=True).past_key_values
        logits = model(ids[:, 5:], past_key_values=cache).logits[0]
        whole = model(ids).logits[0, 5:]
    torch.testing.assert_close(logits, whole, atol=1e-5, rtol=1e-5)


LAYOUTS = {  # drafts per row -> (batched query slots per row, rows attended by a call of their own)
    "alike": (
        [[Draft((4,), "x")], [Draft((6,), "x")], [Draft((8,), "x")], [Draft((9,), "x")]],
        (2, []),
    ),
    "one wide among plain rows": ([[], [], DRAFTS, []], (1, [2])),
    "plain rows": ([[], [], [], []], (1, [])),
    "ragged": ([DRAFTS, [], [Draft(tuple(range(10, 40)), "x")], []], (1, [0, 2])),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_of_other_lengths_and_widths_do_not_disturb_each_other(layout: str) -> None:
    """Four rows of different prompt lengths; their trees make every kind of attention layout:
    one batched call, calls of their own, or both."""
    model = make_tiny_model(seed=3)
    runner = ModelRunner(model)
    assert (
        runner.query_groups == 2
    )  # the tiny model's query heads share KV heads: the calls fold them
    prompts = [PROMPT, [7, 3], list(range(2, 40)), [11, 12, 13]]
    cache = prefilled(runner, prompts)
    drafts, (width, separate) = LAYOUTS[layout]
    trees = [build_tree(prompt[-1], d) for prompt, d in zip(prompts, drafts)]
    # a GPU's dearer calls pick other layouts
    planned = build_layout(trees, cache.lengths, torch.device("cpu"))
    assert (
        planned.query_index.shape[1] if planned.query_index is not None else 0,
        planned.separate_rows,
    ) == (width, separate)
    assert planned.one_token_rows == (
        layout == "plain rows"
    )  # plain decoding: no gather, no scatter
    logits = runner.forward(cache, [RowInput(tree) for tree in trees])
    for prompt, tree, row_logits in zip(prompts, trees, logits):
        assert_nodes_match(model, prompt, tree, row_logits)


def test_the_batched_width_minimizes_query_slots_and_calls() -> None:
    assert batched_width([1] * 16, call_slots=1) == 1  # plain decoding: one call
    assert batched_width([1] * 15 + [5], call_slots=1) == 1  # the tree gets a call of its own
    assert batched_width([3, 5, 5, 9], call_slots=1) == 0  # unlike trees: a call each
    assert (
        batched_width([3, 5, 5, 9], call_slots=16) == 9
    )  # where calls are dear (GPU): one padded call
    assert batched_width([1] * 15 + [64], call_slots=1) == 1  # a prompt chunk beside decode rows
    # the batched call pads every row to the longest: alike trees of unlike lengths get a call each
    assert batched_width([4] * 4, call_slots=1, ends=[300] * 4) == 4
    assert batched_width([4] * 4, call_slots=1, ends=[100, 100, 100, 1600]) == 0


def test_a_prompt_chunk_and_a_first_tree_share_one_row() -> None:
    """Chunked prefill: the last chunk of a prompt carries the first speculation tree."""
    model = make_tiny_model(seed=4)
    runner = ModelRunner(model)
    cache = prefilled(runner, [PROMPT[:3]])
    chunk = PROMPT[2:-1]  # the pending token of the first chunk, then the rest but the last
    tree = build_tree(PROMPT[-1], DRAFTS)
    row = prepend_chain(chunk, tree)
    logits = runner.forward(cache, [RowInput(row, logits_from=len(chunk))])[0]
    assert_nodes_match(model, PROMPT, tree, logits)


def test_compacted_cache_continues_like_a_fresh_decode() -> None:
    """After keeping one branch, the next pass sees exactly prompt + that branch."""
    model = make_tiny_model(seed=2)
    runner = ModelRunner(model)
    cache = prefilled(runner, [PROMPT])
    tree = build_tree(PROMPT[-1], DRAFTS)
    runner.forward(cache, [RowInput(tree)])
    branch = [0, tree.children[0][3], tree.children[tree.children[0][3]][9]]  # root, 3, 9
    cache.commit(0, branch)
    assert cache.lengths == [len(PROMPT) + 2]
    logits = runner.forward(cache, [RowInput(chain_tree([10]))])[0][0]
    torch.testing.assert_close(
        logits, sequential_logits(model, PROMPT + [3, 9, 10]), atol=1e-5, rtol=1e-5
    )


def test_rows_compacted_together_continue_like_fresh_decodes() -> None:
    """One commit for three rows: a branch that moves, a path already in place, a prompt chunk."""
    model = make_tiny_model(seed=2)
    runner = ModelRunner(model)
    prompts = [PROMPT, [7, 3, 9], list(range(2, 30))]
    cache = prefilled(runner, prompts)
    trees = [build_tree(p[-1], DRAFTS) for p in prompts[:2]] + [chain_tree([30, 31, 32])]
    runner.forward(cache, [RowInput(tree) for tree in trees])
    second = trees[0].children[0][3]
    cache.commit_rows({0: [0, second, trees[0].children[second][9]], 1: [0, 1], 2: [0, 1, 2]})
    assert trees[1].token_ids[1] == 3  # node 1 is in place
    kept = [[3, 9], [3], [31, 32]]
    logits = runner.forward(cache, [RowInput(chain_tree([10])) for _ in prompts])
    for prompt, tokens, row_logits in zip(prompts, kept, logits):
        continued = prompt + tokens if prompt is not prompts[2] else prompt[:-1] + [30, 31, 32]
        torch.testing.assert_close(
            row_logits[0], sequential_logits(model, continued + [10]), atol=1e-5, rtol=1e-5
        )


def test_a_removed_row_leaves_the_others_intact_and_the_last_frees_memory() -> None:
    model = make_tiny_model(seed=2)
    runner = ModelRunner(model)
    prompts = [PROMPT, [7, 3, 9], list(range(2, 30))]
    cache = prefilled(runner, prompts)
    assert cache.remove_row(0) == 2  # the last row moved into the freed slot
    survivors = [prompts[2], prompts[1]]
    logits = runner.forward(cache, [RowInput(chain_tree([p[-1]])) for p in survivors])
    for prompt, row_logits in zip(survivors, logits):
        torch.testing.assert_close(
            row_logits[0], sequential_logits(model, prompt), atol=1e-5, rtol=1e-5
        )
    cache.remove_row(1)
    assert cache.nbytes > 0
    cache.remove_row(0)
    assert cache.nbytes == 0 and cache.num_rows == 0


@pytest.mark.parametrize("split", [1, 3, 5])
def test_a_tree_brought_in_two_passes_equals_it_in_one(split: int) -> None:
    """A row may bring only its tree's newer nodes: the earlier ones sit uncommitted in its
    cache from the previous pass (how a draft model grows a tree a depth a pass), beside a row
    that brings nothing and a row that brings a whole tree."""
    model = make_tiny_model(seed=6)
    runner = ModelRunner(model)
    prompts = [PROMPT, [7, 3, 9], list(range(2, 30))]
    cache = prefilled(runner, prompts)
    trees = [build_tree(p[-1], DRAFTS) for p in prompts]
    runner.forward(
        cache,
        [RowInput(_first(trees[0], split)), RowInput(chain_tree([])), RowInput(chain_tree([]))],
    )
    logits = runner.forward(
        cache,
        [RowInput(trees[0], split, cached=split), RowInput(chain_tree([])), RowInput(trees[2])],
    )
    tail = trees[0].num_nodes - split
    assert logits[0].shape[0] == tail and logits[1].shape[0] == 0
    for node in range(split, trees[0].num_nodes):
        expected = sequential_logits(model, prompts[0] + path_to(trees[0], node))
        torch.testing.assert_close(logits[0][node - split], expected, atol=1e-5, rtol=1e-5)
    assert_nodes_match(model, prompts[2], trees[2], logits[2])


def _first(tree: TokenTree, n: int) -> TokenTree:
    """The tree's first n nodes (breadth-first, so a tree again)."""
    return TokenTree(
        tree.token_ids[:n],
        tree.parents[:n],
        tree.depths[:n],
        tree.strategies[:n],
        [{t: c for t, c in kids.items() if c < n} for kids in tree.children[:n]],
    )
