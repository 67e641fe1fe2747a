"""The cross-request suffix index: lookups, seams, eviction and its memory bound."""

from __future__ import annotations

import pytest

from drafting import Draft, Suffix, SuffixIndex, TokenHistory
from drafting.suffix import SuffixWriter


def test_what_followed_an_ngram_in_earlier_outputs_is_proposed() -> None:
    index = SuffixIndex(capacity=100, orders=(3, 2))
    index.append([1, 2, 3, 4, 5])  # one request's output
    index.append([9, 2, 3, 7])  # another's
    drafts = Suffix(index).propose(TokenHistory([8, 1, 2, 3]), 3, 2)
    # [1, 2, 3] matched the first output (-> 4 5); [2, 3] matched both (newest first: -> 7)
    assert drafts == [Draft((4, 5), "suffix", 0, 3), Draft((7,), "suffix", 1, 2)]


@pytest.mark.parametrize(
    "outputs,context,expected",
    [
        # counts rank continuations: 4 followed [2, 3] twice, 6 once (and more recently)
        ([[2, 3, 4], [2, 3, 4], [2, 3, 6]], [2, 3], [(4,), (6,)]),
        # a continuation never crosses into another request's output
        ([[1, 2], [7, 7]], [1, 2], []),
        # nothing indexed yet matches
        ([[5, 6]], [1, 2], []),
    ],
)
def test_suffix_table(outputs, context, expected) -> None:
    index = SuffixIndex(capacity=50, orders=(2,))
    for output in outputs:
        index.append(output)
    assert [d.token_ids for d in Suffix(index).propose(TokenHistory(context), 4, 1)] == expected


def test_memory_is_fixed_and_old_tokens_are_evicted() -> None:
    index = SuffixIndex(capacity=64, orders=(2,))
    size = index.nbytes
    index.append([1, 2, 3])
    for start in range(0, 2000, 10):  # 30 times the capacity of other text
        index.append(list(range(100 + start, 110 + start)))
    assert index.nbytes == size
    assert index.continuations((1, 2), 1, 8) == []  # evicted with the ring
    assert index.continuations((2090, 2091), 1, 8) == [(2092,)]  # the newest text is found


def test_writers_keep_each_requests_tokens_contiguous_across_chunks() -> None:
    index = SuffixIndex(capacity=200, orders=(2,))
    first, second = SuffixWriter(index, chunk=3), SuffixWriter(index, chunk=3)
    for a, b in zip(
        [[1, 2], [3, 4], [5, 6]], [[11, 12], [13, 14], [15, 16]]
    ):  # rounds of two requests interleave
        first.add(a)
        second.add(b)
    first.flush()
    second.flush()
    assert index.continuations((3, 4), 3, 8) == [(5, 6)]  # across first's chunk seam
    # the seam is repeated in the next chunk: the newest occurrence has the full continuation
    assert index.continuations((12, 13), 2, 8) == [(14,), (14, 15)]
