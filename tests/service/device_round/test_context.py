"""The context draft on the device: the tokens after the latest earlier occurrence of the
longest suffix (up to 4 tokens) of a row's recent tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.device_round.context import context_drafts


def reference(history: list[int], window: int, w: int, max_n: int = 4) -> list[int]:
    """Longest n first; the latest occurrence that ends before the suffix starts... or overlaps
    it."""
    recent = history[-window:]
    for n in range(min(max_n, len(recent) - 1), 0, -1):
        suffix = recent[-n:]
        starts = [p for p in range(len(recent) - n) if recent[p : p + n] == suffix]
        if starts:
            return recent[starts[-1] + n : starts[-1] + n + w]
    return []


def _rows(histories: list[list[int]], window: int) -> torch.Tensor:
    recent = torch.full((len(histories), window), -1, dtype=torch.long)
    for row, history in enumerate(histories):
        tail = history[-window:]
        recent[row, window - len(tail) :] = torch.tensor(tail)
    return recent


@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    window, w = 24, 5
    histories = [
        rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(1, 40))).tolist()
        for _ in range(16)
    ]
    drafts, valid = context_drafts(_rows(histories, window), w)
    for row, history in enumerate(histories):
        expected = reference(history, window, w)
        assert drafts[row][valid[row]].tolist() == expected
        assert valid[row].tolist() == [i < len(expected) for i in range(w)]  # a prefix of the draft


def test_longest_match_wins_over_a_later_shorter_one() -> None:
    history = [7, 8, 9, 1, 2, 5, 9, 3, 8, 9]  # "8 9" followed by 1; "9" alone last followed by 3
    drafts, valid = context_drafts(_rows([history], 16), 3)
    assert drafts[0][valid[0]].tolist() == [1, 2, 5]


def test_no_match_and_short_histories_draft_nothing() -> None:
    drafts, valid = context_drafts(_rows([[4], [1, 2, 3]], 8), 4)
    assert not valid.any()
