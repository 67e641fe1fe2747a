"""Context n-gram lookup on literal token arrays."""

from __future__ import annotations

import pytest

from drafting import ContextNgramDrafter, Draft


def tokens(drafts: list[Draft]) -> list[tuple[int, ...]]:
    return [d.token_ids for d in drafts]


@pytest.mark.parametrize(
    "context,k,w,expected",
    [
        # the suffix [1, 2] occurred once before, followed by 3 4 5
        ([1, 2, 3, 4, 5, 9, 1, 2], 1, 3, [(3, 4, 5)]),
        # continuations are cut at w
        ([1, 2, 3, 4, 5, 9, 1, 2], 1, 2, [(3, 4)]),
        # a continuation may run into the suffix itself
        ([7, 8, 7, 8], 1, 3, [(7, 8)]),
        # most frequent continuation first, then the most recent one
        ([5, 1, 5, 2, 5, 1, 5, 3, 5], 3, 1, [(1,), (3,), (2,)]),
        # longer matches come before shorter ones: [2, 5] -> 6 beats [5] -> 7
        ([2, 5, 6, 0, 5, 7, 0, 5, 7, 2, 5], 2, 1, [(6,), (7,)]),
        # duplicates across n are proposed once
        ([4, 5, 6, 4, 5], 3, 1, [(6,)]),
        # no earlier occurrence of the last token: nothing to propose
        ([1, 2, 3, 4], 2, 3, []),
        # k = 0 or w = 0 proposes nothing
        ([1, 2, 1], 0, 3, []),
        ([1, 2, 1], 2, 0, []),
        # too short to look anything up
        ([1], 2, 2, []),
    ],
)
def test_context_ngram_proposals(context, k, w, expected) -> None:
    assert tokens(ContextNgramDrafter(max_n=3).propose(context, k, w)) == expected


def test_drafts_carry_the_strategy_name() -> None:
    drafts = ContextNgramDrafter().propose([1, 2, 1], 1, 1)
    assert drafts == [Draft((2,), "context")]


def test_invalid_match_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        ContextNgramDrafter(max_n=1, min_n=2)
