"""Speculative sampling keeps the model's distribution exactly.

Statistical part: a synthetic bigram "model" over 6 tokens (the logits after a node depend
on its token only) lets the real tree builder and verifier generate 3-token sequences
10,000 times; their empirical distribution is tested (chi-square) against the exact product
of the target distributions, for several temperature/top-p/top-k settings and tree shapes:
trees that branch at the root, and trees whose drafts share their first token and branch
below it (where a rejected child's residual distribution is taken deeper in the tree).
The same test rejects a known-wrong rule (accept a draft whenever it is the argmax).

End-to-end part: on the tiny Llama, sampled speculative output is token-identical to plain
sampling with the same seed (both read the same per-position uniforms), for many seeds.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from scipy.stats import chisquare

from drafting import Draft
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.sampling import PositionUniforms, target_probs
from service.engine.verifier import Verdict, verify
from service.model.tree import TokenTree, build_tree
from tests.helpers.costs import MEMORY_BOUND

VOCAB, LENGTH, DRAWS, START = 6, 3, 10000, 0
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5  # [token, next]


@functools.cache
def tree_after(token: int, k: int, w: int, deep: bool = False) -> tuple[TokenTree, torch.Tensor]:
    """The round's tree after `token`, and its nodes' logits (a bigram model: by node token)."""
    tree = build_tree(token, drafts_after(token, k, w, deep) if k else [])
    assert (
        not deep or k < 2 or len(tree.children[0]) == 1 < len(tree.children[1])
    )  # branches at depth 1
    return tree, TABLE[tree.token_ids]  # [num_nodes, vocab]


def drafts_after(token: int, k: int, w: int, deep: bool = False) -> list[Draft]:
    """Deterministic drafts, each chained greedily to w: from the k most likely next tokens, or
    (`deep`) all from the likeliest one, through the k most likely tokens after it."""
    if deep:
        first = int(TABLE[token].argmax())
        starts = [[first, second] for second in TABLE[first].topk(k).indices.tolist()]
    else:
        starts = [[first] for first in TABLE[token].topk(k).indices.tolist()]
    drafts = []
    for rank, chain in enumerate(starts):
        while len(chain) < w:
            chain.append(int(TABLE[chain[-1]].argmax()))
        drafts.append(Draft(tuple(chain), "test", rank))
    return drafts


def wrong_verify(tree, logits, sampling, uniforms, first_position) -> Verdict:
    """The tempting rule: take a child whenever it is the argmax; otherwise sample."""
    node, path = 0, []
    while True:
        best = int(logits[node].argmax())
        if best in tree.children[node]:
            node = tree.children[node][best]
            path.append(node)
            continue
        u = uniforms.at([first_position + tree.depths[node]])
        cdf = target_probs(logits[node : node + 1], sampling).cumsum(-1)
        bonus = int(torch.searchsorted(cdf, u[:, None].float() * cdf[:, -1:]).clamp(max=VOCAB - 1))
        return Verdict(path, [tree.token_ids[i] for i in path], bonus)


def sample_sequence(
    seed: int, sampling: SamplingParams, k: int, w: int, rule=verify, deep: bool = False
) -> tuple[int, ...]:
    uniforms, tokens = PositionUniforms(seed), [START]
    while len(tokens) <= LENGTH:
        tree, logits = tree_after(tokens[-1], k, w, deep)
        tokens += rule(tree, logits, sampling, uniforms, first_position=len(tokens)).token_ids
    return tuple(tokens[1 : LENGTH + 1])


def chi_square_pvalue(
    sampling: SamplingParams, k: int, w: int, rule=verify, deep: bool = False
) -> float:
    probs = target_probs(TABLE, sampling)  # [token, next]
    cells = list(itertools.product(range(VOCAB), repeat=LENGTH))
    index = {cell: i for i, cell in enumerate(cells)}
    expected = (
        torch.tensor([float(probs[START, a] * probs[a, b] * probs[b, c]) for a, b, c in cells])
        * DRAWS
    )
    observed = torch.zeros(len(cells))
    for seed in range(DRAWS):
        observed[index[sample_sequence(seed, sampling, k, w, rule, deep)]] += 1
    possible = expected > 0
    assert observed[~possible].sum() == 0  # nothing outside the top-k/top-p support
    rare = possible & (expected < 5)  # pooled into one cell, so the chi-square approximation holds
    obs = [
        *observed[possible & ~rare].tolist(),
        *([observed[rare].sum().item()] if rare.any() else []),
    ]
    exp = [
        *expected[possible & ~rare].tolist(),
        *([expected[rare].sum().item()] if rare.any() else []),
    ]
    obs, exp = torch.tensor(obs), torch.tensor(exp)
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize(
    "sampling,k,w",
    [
        (SamplingParams(temperature=1.0), 3, 2),
        (SamplingParams(temperature=0.7, top_p=0.9), 2, 3),
        (SamplingParams(temperature=1.3, top_k=4), 4, 1),
        (SamplingParams(temperature=1.0, top_k=5, top_p=0.8), 1, 3),
        (SamplingParams(temperature=1.0), 0, 0),  # plain sampling through the same path
    ],
)
def test_sequences_follow_the_target_distribution(sampling: SamplingParams, k: int, w: int) -> None:
    assert chi_square_pvalue(sampling, k, w) > 0.01


@pytest.mark.parametrize(
    "sampling,k,w",
    [
        (SamplingParams(temperature=1.0), 3, 3),
        (SamplingParams(temperature=0.7, top_p=0.9), 2, 3),
        (SamplingParams(temperature=1.3, top_k=4), 4, 2),
    ],
)
def test_trees_branching_below_the_root_keep_the_target_distribution(
    sampling: SamplingParams, k: int, w: int
) -> None:
    assert chi_square_pvalue(sampling, k, w, deep=True) > 0.01


@pytest.mark.parametrize("deep", [False, True], ids=["branching at the root", "branching below it"])
def test_the_argmax_rule_is_caught(deep: bool) -> None:
    """Same statistic, known-wrong rule: the distribution visibly shifts."""
    assert (
        chi_square_pvalue(SamplingParams(temperature=1.0), 3, 2, rule=wrong_verify, deep=deep)
        < 0.01
    )


@pytest.mark.parametrize(
    "sampling,k,w,mode",
    [
        (SamplingParams(temperature=1.0), 3, 3, "fixed"),
        (SamplingParams(temperature=0.7, top_p=0.9), 8, 5, "fixed"),
        (SamplingParams(temperature=1.5, top_k=8), 6, 4, "auto"),
    ],
)
def test_speculative_sampling_equals_plain_sampling_seed_for_seed(
    tiny_engine: Engine, sampling: SamplingParams, k: int, w: int, mode: str
) -> None:
    tiny_engine.profile = MEMORY_BOUND
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    accepted = 0
    for seed in range(12):
        seeded = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed)
        plain = tiny_engine.complete(prompt, GenerationParams(30, sampling=seeded))
        spec = tiny_engine.complete(
            prompt, GenerationParams(30, speculation=SpeculationParams(k, w, mode), sampling=seeded)
        )
        assert spec.token_ids == plain.token_ids
        accepted += spec.num_accepted_tokens
    assert accepted > 0  # speculation really took part


def test_same_seed_same_output_and_seeds_differ(tiny_engine: Engine) -> None:
    def run(seed: int | None) -> list[int]:
        params = GenerationParams(
            30, speculation=SpeculationParams(4, 3), sampling=SamplingParams(1.0, seed=seed)
        )
        return tiny_engine.complete([5, 9, 13], params).token_ids

    assert run(42) == run(42)
    assert len({tuple(run(seed)) for seed in range(5)}) > 1
    assert run(None) != run(None) or run(None) != run(None)  # unseeded: fresh randomness
