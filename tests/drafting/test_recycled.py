"""The successor table, the static rank-path template and the recycled strategy, on literal
arrays."""

from __future__ import annotations

import numpy as np
import pytest

from drafting import (
    Draft,
    ModelTables,
    PassDistributions,
    Recycled,
    SuccessorTable,
    TableSlot,
    TokenHistory,
    rank_paths,
)
from drafting.recycled import GROWTH


def follow(
    table: SuccessorTable, token: int, ranks: tuple[int, ...], previous: int = -1
) -> tuple[int, ...]:
    """One path of ranks walked from `token` (after `previous`)."""
    return table.walk([(previous, token)], np.array([ranks], dtype=np.int64))[0]


def passed(
    node_tokens: list[int], top_ids: list[list[int]], stop_node: int = 0
) -> PassDistributions:
    return PassDistributions(np.array(node_tokens), np.array(top_ids), stop_node)


def test_every_node_refreshes_its_tokens_row_in_place() -> None:
    table = SuccessorTable(top_k=2)
    table.observe(passed([3, 5], [[4, 6], [7, 8]]))  # after 3: 4 then 6; after 5: 7 then 8
    assert table.row(3) == [4, 6] and table.row(5) == [7, 8]
    table.observe(passed([3], [[9, 4]]))  # a later pass overwrites the row
    assert table.row(3) == [9, 4] and table.row(5) == [7, 8]
    assert table.row(0) == [] and table.row(100) == []  # never observed


def test_memory_is_bounded_by_the_vocabulary_not_the_traffic() -> None:
    table = SuccessorTable(top_k=4)
    rng = np.random.default_rng(0)
    for _ in range(200):  # many passes over a vocabulary of 50
        tokens = rng.integers(0, 50, size=16)
        table.observe(PassDistributions(tokens, rng.integers(0, 50, size=(16, 4)), 0))
    assert table.successors.shape == (GROWTH, 4)  # one step of rows holds the whole vocabulary
    assert table.nbytes == GROWTH * 4 * 4


def test_unobserved_rows_fall_back_to_the_model_bigram_table() -> None:
    bigram = np.array([[1, 2], [2, 0], [0, 1]], dtype=np.uint32)
    slot = TableSlot(ModelTables(unigram=np.array([0], dtype=np.uint32), bigram=bigram))
    table = SuccessorTable(top_k=2, fallback=slot)
    table.observe(passed([1], [[1, 1]]))
    assert table.row(1) == [1, 1]  # observed: the table's own row
    assert table.row(2) == [0, 1]  # never observed: the model's bigram row


def test_rows_read_before_a_pass_are_read_anew_after_it() -> None:
    bigram = np.array([[1, 2], [2, 0], [0, 1]], dtype=np.uint32)
    table = SuccessorTable(
        top_k=2,
        fallback=TableSlot(ModelTables(unigram=np.array([0], dtype=np.uint32), bigram=bigram)),
    )
    assert table.row(2) == [0, 1]  # before any pass: the fallback's row
    table.observe(passed([2, 2], [[1, 1], [1, 0]]))  # a token at two nodes keeps the last
    assert table.row(2) == [1, 0]
    table.observe(passed([2], [[2]]))  # a narrower pass: the row's tail stays
    assert table.row(2) == [2, 0] and table.successors[2].tolist() == [2, 0]


def test_follow_takes_one_successor_per_rank_and_stops_where_a_row_runs_out() -> None:
    table = SuccessorTable(top_k=2)
    table.observe(passed([1, 2, 3], [[2, 3], [3, 1], [1, 2]]))
    assert follow(table, 1, (0, 0, 0)) == (2, 3, 1)
    assert follow(table, 1, (1, 1)) == (3, 2)
    assert follow(table, 1, (0, 2)) == (2,)  # rank 2 of a 2-wide row does not exist
    assert follow(table, 7, (0,)) == ()


@pytest.mark.parametrize(
    "k,w,expected",
    [
        # the spine first, then branches that leave it at the root with the next ranks
        (3, 2, ((0, 0), (1, 0), (2, 0))),
        (4, 4, ((0, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (0, 1, 0, 0))),
        # one path of one token: the top successor
        (1, 1, ((0,),)),
        (0, 3, ()),
    ],
)
def test_rank_paths_are_a_static_template_wide_near_the_root(k, w, expected) -> None:
    assert rank_paths(k, w) == expected


def test_recycled_drafts_follow_the_template_from_the_newest_token() -> None:
    table = SuccessorTable(top_k=3)
    table.observe(passed([1, 2, 3, 4], [[2, 3, 4], [3, 1, 4], [4, 1, 2], [1, 2, 3]]))
    drafts = Recycled(table).propose(TokenHistory([9, 1]), 3, 2)
    # (0, 0): 1 -> 2 -> 3; (1, 0): 1 -> 3 -> 4; (2, 0): 1 -> 4 -> 1
    assert drafts == [
        Draft((2, 3), "recycled", 0),
        Draft((3, 4), "recycled", 1),
        Draft((4, 1), "recycled", 2),
    ]


def test_nothing_is_proposed_before_anything_was_observed() -> None:
    assert Recycled(SuccessorTable()).propose(TokenHistory([1, 2]), 4, 4) == []


def with_parents(
    node_tokens: list[int], parent_tokens: list[int], top_ids: list[list[int]]
) -> PassDistributions:
    return PassDistributions(np.array(node_tokens), np.array(top_ids), 0, np.array(parent_tokens))


def test_pair_rows_hold_what_followed_two_tokens_and_come_before_the_tokens_own_row() -> None:
    table = SuccessorTable(top_k=2, pair_bits=8)
    # after (0, 1): 2; after (1, 2): 3; after (5, 2): 4 — so the row of 2 alone holds 4 (the last)
    table.observe(with_parents([1, 2, 2], [0, 1, 5], [[2, 9], [3, 9], [4, 9]]))
    assert (
        table.pair_row(1, 2) == [3, 9] and table.pair_row(5, 2) == [4, 9] and table.row(2) == [4, 9]
    )
    assert follow(table, 2, (0,), previous=1) == (3,)  # the pair knows better than the token alone
    assert follow(table, 2, (0,), previous=5) == (4,)
    assert follow(table, 2, (0,), previous=7) == (4,)  # a pair never seen: the token's own row
    assert follow(table, 0, (0, 0, 0), previous=-1) == ()  # 0 alone was never a node
    assert follow(table, 1, (0, 0), previous=0) == (2, 3)  # each step from the newest two tokens
    # the recycled strategy steps from the history's newest two tokens
    assert Recycled(table).propose(TokenHistory([1, 2]), 1, 1) == [Draft((3,), "recycled", 0)]
    assert Recycled(table).propose(TokenHistory([5, 2]), 1, 1) == [Draft((4,), "recycled", 0)]


def test_the_root_of_a_one_token_context_learns_no_pair() -> None:
    table = SuccessorTable(top_k=1, pair_bits=8)
    table.observe(with_parents([4, 5], [-1, 4], [[5], [6]]))
    assert table.pair_row(-1, 4) == [] and table.pair_row(4, 5) == [6] and table.row(4) == [5]


def test_a_narrower_pass_leaves_no_entry_of_the_pair_that_held_the_bucket() -> None:
    table = SuccessorTable(top_k=3, pair_bits=1)  # 2 buckets
    table.observe(with_parents([2, 3], [1, 1], [[7, 8, 9], [4, 5, 6]]))
    held = {(1, 2): [7, 8, 9], (1, 3): [4, 5, 6]}
    assert [table.pair_row(*pair) for pair in held] == list(held.values())
    # pairs (a, 2) for several a: one of them takes a bucket a row above had, with 2 candidates
    table.observe(with_parents([2, 2, 2], [10, 11, 12], [[20, 21], [22, 23], [24, 25]]))
    rows = [table.pair_row(previous, 2) for previous in (10, 11, 12)]
    assert rows[-1] == [24, 25] and all(
        row in ([], [20 + 2 * i, 21 + 2 * i]) for i, row in enumerate(rows)
    )
    assert all(table.pair_row(*pair) in ([], row) for pair, row in held.items())
    written = {(7, 8, 9), (4, 5, 6), (20, 21, -1), (22, 23, -1), (24, 25, -1)}
    assert {
        tuple(row) for row in table.pair_successors.tolist()
    } <= written  # never a mix of two rows


def test_a_table_without_pair_rows_ignores_the_parents() -> None:
    table = SuccessorTable(top_k=2)  # Token Recycling's: rows keyed by one token
    table.observe(with_parents([1, 2, 2], [0, 1, 5], [[2, 9], [3, 9], [4, 9]]))
    assert table.pair_row(1, 2) == [] and follow(table, 2, (0,), previous=1) == (4,)
    assert table.nbytes == GROWTH * 2 * 4


def test_pair_rows_take_fixed_memory_and_a_bucket_holds_only_its_newest_pair() -> None:
    table = SuccessorTable(top_k=2, pair_bits=2)  # 4 buckets: pairs evict each other
    pair_bytes = table.pair_keys.nbytes + table.pair_successors.nbytes
    rng = np.random.default_rng(0)
    newest: dict[tuple[int, int], list[int]] = {}
    for _ in range(50):
        parents, tokens = rng.integers(0, 2**20, size=(2, 3))  # token ids far past 2**16
        top = rng.integers(0, 2**20, size=(3, 2))
        table.observe(with_parents(tokens.tolist(), parents.tolist(), top.tolist()))
        newest.update(zip(zip(parents.tolist(), tokens.tolist()), top.tolist()))
        known = {pair: table.pair_row(*pair) for pair in newest}
        assert all(
            row in ([], newest[pair]) for pair, row in known.items()
        )  # its own newest row, or none
        assert 1 <= sum(1 for row in known.values() if row) <= 4
        assert (
            known[parents[-1].item(), tokens[-1].item()] == top[-1].tolist()
        )  # the last written stays
    assert table.pair_keys.nbytes + table.pair_successors.nbytes == pair_bytes == 4 * 8 + 4 * 2 * 4


def test_a_walk_steps_row_by_row_from_each_paths_start() -> None:
    """The compiled walk against stepping through `pair_row` and `row` by hand: random passes
    over a small vocabulary (pair buckets shared, some tokens only the fallback knows), starts
    at seen pairs and at others, paths cut short."""
    rng = np.random.default_rng(1)
    bigram = rng.integers(0, 12, size=(12, 3)).astype(np.uint32)
    table = SuccessorTable(
        top_k=3,
        fallback=TableSlot(ModelTables(np.array([0], dtype=np.uint32), bigram)),
        pair_bits=3,
    )
    seen = []
    for _ in range(5):
        nodes, parents = rng.integers(0, 10, size=(2, 6))  # tokens 10 and 11: the fallback's alone
        table.observe(
            with_parents(
                nodes.tolist(), parents.tolist(), rng.integers(0, 12, size=(6, 3)).tolist()
            )
        )
        seen += zip(parents.tolist(), nodes.tolist())
    others = np.stack(
        [rng.integers(-1, 12, size=30), rng.integers(0, 12, size=30)], axis=1
    ).tolist()  # -1: no previous
    starts = [list(pair) for pair in seen] + others
    paths = rng.integers(0, 3, size=(len(starts), 5))
    depths = rng.integers(0, 6, size=len(starts)).tolist()
    assert sum(1 for p, t in starts if table.pair_row(p, t)) >= 5  # pair rows are walked from

    def by_hand(previous: int, token: int, ranks: list[int]) -> tuple[int, ...]:
        path: list[int] = []
        for rank in ranks:
            row = table.pair_row(previous, token) or table.row(token)
            if rank >= len(row):
                break
            previous, token = token, row[rank]
            path.append(token)
        return tuple(path)

    walked = table.walk(starts, paths, depths)
    assert walked == [
        by_hand(p, t, ranks[:d]) for (p, t), ranks, d in zip(starts, paths.tolist(), depths)
    ]
    assert any(len(path) == 5 for path in walked) and any(0 < len(path) < 5 for path in walked)
    assert table.walk([starts[0]], paths) == [
        by_hand(*starts[0], ranks) for ranks in paths.tolist()
    ]  # one start for all
