"""Logit hints: runner-up tokens of the last distribution start branches, on literal arrays."""

from __future__ import annotations

import numpy as np

from drafting import Draft, LogitHints, PassDistributions, SuccessorTable, TokenHistory


def table() -> SuccessorTable:
    successors = SuccessorTable(top_k=2)
    # after 5: 6; after 6: 7; after 7: 5; after 8: 9; after 9: 8
    successors.observe(
        PassDistributions(
            np.array([5, 6, 7, 8, 9]), np.array([[6, 0], [7, 0], [5, 0], [9, 0], [8, 0]]), 0
        )
    )
    return successors


def test_runner_ups_start_branches_continued_by_the_successor_table() -> None:
    history = TokenHistory([1, 2, 3])
    history.hints = (3, 5, 8)  # the pass chose 3 (the newest token); 5 and 8 were next likeliest
    drafts = LogitHints(table()).propose(history, 4, 3)
    assert drafts == [Draft((5, 6, 7), "logit", 0), Draft((8, 9, 8), "logit", 1)]
    assert LogitHints(table()).propose(history, 4, 1) == [
        Draft((5,), "logit", 0),
        Draft((8,), "logit", 1),
    ]  # guesses alone


def test_the_context_continues_a_guess_it_has_seen_after_the_same_tokens() -> None:
    history = TokenHistory([2, 3, 8, 4, 4, 0, 2, 3])  # earlier, 3 was followed by 8, then 4 4
    history.hints = (3, 8)
    assert LogitHints(table()).propose(history, 2, 3) == [Draft((8, 4, 4), "logit", 0)]
    # a match that ends the text is finished by the successor table: [3, 8] -> 4, then 8 -> 9
    short = TokenHistory([3, 8, 4, 1, 3])
    short.hints = (8,)
    assert LogitHints(table()).propose(short, 1, 3) == [Draft((8, 4, 1), "logit", 0)]


def test_no_hints_before_a_pass_and_none_after_the_history_moves_on() -> None:
    history = TokenHistory([1, 2])
    assert LogitHints(table()).propose(history, 3, 3) == []
    history.hints = (2, 5)
    history.extend([7])  # the hints described the position of 2, not of 7
    assert LogitHints(table()).propose(history, 3, 3) == []


def test_a_guess_is_continued_from_the_row_of_the_newest_token_and_the_guess() -> None:
    paired = SuccessorTable(top_k=2, pair_bits=8)
    paired.observe(
        PassDistributions(
            np.array([5, 6, 7, 8, 9]), np.array([[6, 0], [7, 0], [5, 0], [9, 0], [8, 0]]), 0
        )
    )
    # after 3 then 5 the model predicted 8, after 5 then 8: 4; a later pass saw 5 alone before 6
    paired.observe(
        PassDistributions(np.array([5, 8]), np.array([[8, 0], [4, 0]]), 0, np.array([3, 5]))
    )
    paired.observe(PassDistributions(np.array([5]), np.array([[6, 0]]), 0))
    history = TokenHistory([1, 2, 3])
    history.hints = (3, 5)
    assert LogitHints(paired).propose(history, 1, 3) == [Draft((5, 8, 4), "logit", 0)]
    history.extend([2])  # the same guess after another newest token: no pair row, 5's own
    history.hints = (2, 5)
    assert LogitHints(paired).propose(history, 1, 3) == [Draft((5, 6, 7), "logit", 0)]
