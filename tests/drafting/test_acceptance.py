"""The censored geometric acceptance estimate."""

from __future__ import annotations

import random

import pytest

from drafting.acceptance import Acceptance, AcceptanceCounts, blend


def test_expected_tokens_sums_the_node_probabilities() -> None:
    acceptance = Acceptance(p=0.6, c=0.5)
    for w in range(1, 6):  # the token at depth d is accepted with probability p·c^(d-1)
        nodes = sum(acceptance.p * acceptance.c ** (d - 1) for d in range(1, w + 1))
        assert acceptance.expected_tokens(w) == pytest.approx(nodes)
    assert Acceptance(p=0.5, c=1.0).expected_tokens(4) == 2.0


def test_censored_observations_recover_the_true_rates() -> None:
    """Simulate drafts whose matches are cut by a random cap; the estimate stays unbiased."""
    rng = random.Random(0)
    p, c = 0.4, 0.7
    counts = AcceptanceCounts()
    for _ in range(20000):
        length = 0
        if rng.random() < p:
            length = 1
            while rng.random() < c:
                length += 1
        cap = rng.randint(1, 6)
        counts.observe(min(length, cap), cap)
    estimate = blend(counts, Acceptance(0.5, 0.5), prior_weight=1.0)
    assert estimate.p == pytest.approx(p, abs=0.02)
    assert estimate.c == pytest.approx(c, abs=0.02)


@pytest.mark.parametrize(
    "accepted,cap,expected",
    [
        (0, 3, AcceptanceCounts(1, 0, 0, 0)),  # first token rejected
        (2, 3, AcceptanceCounts(1, 1, 2, 1)),  # 1 hit, then 1 hit and 1 miss
        (3, 3, AcceptanceCounts(1, 1, 2, 2)),  # matched to the cap: the miss was not seen
        (0, 0, AcceptanceCounts(0, 0, 0, 0)),  # nothing could be compared
    ],
)
def test_observation_counts(accepted: int, cap: int, expected: AcceptanceCounts) -> None:
    counts = AcceptanceCounts()
    counts.observe(accepted, cap)
    assert counts == expected


@pytest.mark.parametrize(
    "accepted,cap,shared,expected",
    [
        (0, 3, 1, AcceptanceCounts(0, 0, 0, 0)),  # the shared token was rejected: its owner's miss
        (1, 3, 1, AcceptanceCounts(0, 0, 1, 0)),  # shared accepted, its own next token missed
        (2, 3, 1, AcceptanceCounts(0, 0, 2, 1)),  # its own token hit, the one after missed
        (3, 3, 1, AcceptanceCounts(0, 0, 2, 2)),  # matched to the cap
        (1, 1, 1, AcceptanceCounts(0, 0, 0, 0)),  # nothing of its own could be compared
    ],
)
def test_a_draft_is_scored_from_its_first_token_of_its_own(
    accepted: int, cap: int, shared: int, expected: AcceptanceCounts
) -> None:
    counts = AcceptanceCounts()
    counts.observe(accepted, cap, shared)
    assert counts == expected


def test_prior_fades_with_evidence() -> None:
    counts = AcceptanceCounts()
    prior = Acceptance(0.5, 0.5)
    assert blend(counts, prior, 4.0) == prior
    for _ in range(100):
        counts.observe(0, 4)
    assert blend(counts, prior, 4.0).p < 0.05
