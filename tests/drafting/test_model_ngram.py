"""Unigram, bigram and extended-bigram strategies over hand-made tables."""

from __future__ import annotations

import numpy as np

from drafting import (
    Draft,
    ExtendedBigram,
    ModelBigram,
    ModelTables,
    ModelUnigram,
    TableSlot,
    TokenHistory,
)

# vocabulary of 5; after token x the model's top-3 next tokens are BIGRAM[x]
BIGRAM = np.array([[1, 2, 3], [2, 0, 4], [3, 1, 0], [4, 4, 1], [0, 1, 2]], dtype=np.uint32)
TABLES = ModelTables(unigram=np.array([4, 0, 2], dtype=np.uint32), bigram=BIGRAM)
HISTORY = TokenHistory([3, 1])  # newest token: 1


def test_unigram_proposes_the_top_tokens_whatever_the_context() -> None:
    drafts = ModelUnigram(TableSlot(TABLES)).propose(HISTORY, 2, 4)
    assert drafts == [Draft((4,), "unigram", 0), Draft((0,), "unigram", 1)]


def test_bigram_proposes_the_top_successors_of_the_newest_token() -> None:
    drafts = ModelBigram(TableSlot(TABLES)).propose(HISTORY, 3, 4)
    assert [d.token_ids for d in drafts] == [(2,), (0,), (4,)]


def test_extended_bigram_chains_top_1_successors_to_w_tokens() -> None:
    drafts = ExtendedBigram(TableSlot(TABLES)).propose(HISTORY, 2, 4)
    # after 1: first guesses 2 and 0; then 2->3->4, and 0->1->2
    assert [d.token_ids for d in drafts] == [(2, 3, 4, 0), (0, 1, 2, 3)]
    assert [d.rank for d in drafts] == [0, 1]


def test_chain_keeps_a_given_prefix() -> None:
    assert TABLES.chain((3,), 3) == (3, 4, 0)
    assert TABLES.chain((1, 2, 3), 2) == (1, 2, 3)  # already long enough


def test_strategies_wait_for_their_tables() -> None:
    empty = TableSlot()
    for strategy in (ModelUnigram(empty), ModelBigram(empty), ExtendedBigram(empty)):
        assert strategy.propose(HISTORY, 3, 3) == []
    empty.tables = TABLES
    assert ModelBigram(empty).propose(HISTORY, 1, 1) == [Draft((2,), "bigram", 0)]


def test_partial_tables_draft_for_the_rows_done_and_nothing_past_them() -> None:
    partial = TableSlot(ModelTables(unigram=TABLES.unigram, bigram=BIGRAM[:3]))  # tokens 0-2
    assert [d.token_ids for d in ModelBigram(partial).propose(HISTORY, 2, 1)] == [(2,), (0,)]
    # after 1: 2 -> 3, and token 3 has no row yet: the chain stops there
    assert [d.token_ids for d in ExtendedBigram(partial).propose(HISTORY, 1, 4)] == [(2, 3)]
    assert ModelBigram(partial).propose(TokenHistory([1, 4]), 3, 1) == []
