"""logit_bias and the penalties at every tree node, against a direct computation per node from
the node's own token lists (prompt, committed output, drafted path)."""

from __future__ import annotations

import pytest
import torch

from drafting import Draft
from service.engine.logits_adjuster import LogitsAdjuster, path_counts
from service.engine.params import SamplingParams
from service.model.tree import TokenTree, build_tree
from tests.helpers.engines import reference_adjusted_logits

VOCAB = 16
PROMPT = [3, 4, 5, 3]
OUTPUT = [7, 4, 7, 9]  # committed so far; the pending token, 9, is the tree's root
DRAFTS = [
    Draft((7, 7, 2), "test", 0),
    Draft((7, 3), "test", 1),
    Draft((4, 9, 9), "test", 2),
    Draft((11,), "test", 3),
]


def path_of(tree: TokenTree, node: int) -> list[int]:
    """The drafted tokens from the root (excluded) down to `node` (included)."""
    path = []
    while node > 0:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return path[::-1]


CONTROLS = [
    SamplingParams(logit_bias={2: 5.0, 7: -100.0, 15: 0.5}),
    SamplingParams(repetition_penalty=1.7),  # positive logits divided, negative multiplied
    SamplingParams(repetition_penalty=0.6),  # below 1: repeats encouraged
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-1.3),
    SamplingParams(
        1.0,
        logit_bias={9: 2.0},
        repetition_penalty=1.3,
        frequency_penalty=-0.4,
        presence_penalty=2.0,
    ),
]


@pytest.mark.parametrize(
    "sampling", CONTROLS, ids=["bias", "repetition", "repetition<1", "frequency", "presence", "all"]
)
def test_each_node_is_adjusted_from_its_own_path(sampling: SamplingParams) -> None:
    tree = build_tree(OUTPUT[-1], DRAFTS)
    # [num_nodes, vocab]
    logits = torch.randn(tree.num_nodes, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    raw = logits.clone()
    adjusted = LogitsAdjuster(sampling, PROMPT, VOCAB, torch.device("cpu"))(
        logits, tree, PROMPT + OUTPUT
    )
    expected = torch.stack(
        [
            reference_adjusted_logits(logits[node], PROMPT, OUTPUT + path_of(tree, node), sampling)
            for node in range(tree.num_nodes)
        ]
    )
    torch.testing.assert_close(adjusted, expected, rtol=0, atol=1e-6)
    assert torch.equal(
        logits, raw
    )  # the raw logits stay raw (logprobs and the drafts' tables read them)


def test_counts_catch_up_with_each_round_as_a_fresh_adjuster_would() -> None:
    sampling = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    adjuster = LogitsAdjuster(sampling, PROMPT, VOCAB, torch.device("cpu"))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    history = list(PROMPT)
    for round_tokens in ([], [7], [4, 7, 7], [], [9, 2]):
        history += round_tokens
        tree = build_tree(history[-1], [])
        fresh = LogitsAdjuster(sampling, PROMPT, VOCAB, torch.device("cpu"))
        assert torch.equal(adjuster(logits, tree, history), fresh(logits, tree, history))
        expected = reference_adjusted_logits(logits[0], PROMPT, history[len(PROMPT) :], sampling)
        torch.testing.assert_close(adjuster(logits, tree, history)[0], expected, rtol=0, atol=1e-6)


def test_path_counts_hold_each_nodes_drafted_tokens() -> None:
    # tokens [9, 7, 4, 11, 7, 3, 9, 2, 9], parents [-1, 0, 0, 0, 1, 1, 2, 4, 6]:
    # node 7's path is 7 7 2
    tree = build_tree(9, DRAFTS)
    counts = path_counts(tree, VOCAB, torch.device("cpu"))  # [num_nodes, vocab]
    for node in range(tree.num_nodes):
        expected = torch.bincount(
            torch.tensor(path_of(tree, node), dtype=torch.long), minlength=VOCAB
        ).float()
        assert torch.equal(counts[node], expected), node
    assert counts[0].sum() == 0  # the root is committed: counted with the output, not here
    assert counts.sum(dim=-1).tolist() == tree.depths


def test_requests_without_adjustments_get_no_adjuster() -> None:
    cpu = torch.device("cpu")
    assert (
        LogitsAdjuster.for_request(
            SamplingParams(0.7, 0.9, 5, seed=1, min_p=0.1), PROMPT, VOCAB, cpu
        )
        is None
    )
    assert (
        LogitsAdjuster.for_request(SamplingParams(presence_penalty=0.1), PROMPT, VOCAB, cpu)
        is not None
    )


def test_a_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        LogitsAdjuster(SamplingParams(logit_bias={VOCAB: 1.0}), PROMPT, VOCAB, torch.device("cpu"))
