"""Context n-gram lookup and its incremental index, on literal token arrays."""

from __future__ import annotations

import pytest

from drafting import ContextNgram, Draft, TokenHistory


def proposals(context: list[int], k: int, w: int, max_n: int = 3) -> list[tuple[int, ...]]:
    history = TokenHistory(context, max_n=max_n)
    return [d.token_ids for d in ContextNgram(max_n=max_n).propose(history, k, w)]


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
    assert proposals(context, k, w) == expected


def test_drafts_carry_strategy_rank_and_match_length() -> None:
    drafts = ContextNgram().propose(TokenHistory([5, 1, 5, 2, 5]), 2, 1)
    assert drafts == [Draft((2,), "context", 0, 1), Draft((1,), "context", 1, 1)]
    # "1 2 3" occurred before (a 3-token match, then 9); "3" alone was also followed by 7
    drafts = ContextNgram().propose(TokenHistory([1, 2, 3, 9, 5, 3, 7, 1, 2, 3]), 2, 1)
    assert drafts == [Draft((9,), "context", 0, 3), Draft((7,), "context", 1, 1)]


def test_index_grows_with_the_history() -> None:
    """Extending token by token gives the same proposals as indexing the whole context."""
    context = [
        3,
        1,
        4,
        1,
        5,
        9,
        2,
        6,
        5,
        3,
        5,
        8,
        9,
        7,
        9,
        3,
        2,
        3,
        8,
        4,
        6,
        2,
        6,
        4,
        3,
        3,
        8,
        3,
        2,
        7,
        9,
        5,
    ]
    incremental = TokenHistory(context[:1])
    for end in range(2, len(context) + 1):
        incremental.extend(context[end - 1 : end])
        batch = TokenHistory(context[:end])
        for n in range(1, 5):
            assert incremental.continuation_starts(n, 100) == batch.continuation_starts(n, 100)
        drafter = ContextNgram()
        assert drafter.propose(incremental, 3, 4) == drafter.propose(batch, 3, 4)


def test_only_the_most_recent_occurrences_are_examined() -> None:
    history = TokenHistory([7, 1] * 5 + [7, 2] + [7])  # 7 was followed by 1 five times, then 2
    assert ContextNgram(max_n=1, most_recent=1).propose(history, 2, 1) == [
        Draft((2,), "context", 0, 1)
    ]
    assert [d.token_ids for d in ContextNgram(max_n=1).propose(history, 2, 1)] == [(1,), (2,)]


def test_invalid_match_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        ContextNgram(max_n=1, min_n=2)


def test_a_tail_continues_the_lookup_past_the_history() -> None:
    history = TokenHistory([1, 2, 3, 4, 1, 2, 9])
    ngram = ContextNgram()
    # history + (1, 2): "1 2" was followed by 3 4 and by 9
    assert ngram.continuations(history, 2, 2, tail=(1, 2)) == [(9,), (3, 4)]
    assert ngram.continuations(history, 1, 2, tail=(3,)) == [(4, 1)]
    assert ngram.continuations(history, 1, 2, tail=(7,)) == []  # 7 never occurred


def test_an_index_caught_up_after_many_tokens_equals_one_kept_up_token_by_token() -> None:
    """The index catches up at the first lookup after new tokens: looked up only now and then
    (a quiet auto request), it answers as one looked up after every token."""
    context = [
        3,
        1,
        4,
        1,
        5,
        9,
        2,
        6,
        5,
        3,
        5,
        8,
        9,
        7,
        9,
        3,
        2,
        3,
        8,
        4,
        6,
        2,
        6,
        4,
        3,
        3,
        8,
        3,
        2,
        7,
        9,
        5,
    ] * 2
    every, sometimes = TokenHistory(context[:3]), TokenHistory(context[:3])
    for end in range(4, len(context) + 1):
        every.extend(context[end - 1 : end])
        sometimes.extend(context[end - 1 : end])
        every.continuation_starts(1, 100)
        if end % 7 == 0 or end == len(context):
            assert all(
                sometimes.continuation_starts(n, 100) == every.continuation_starts(n, 100)
                for n in range(1, 5)
            )
