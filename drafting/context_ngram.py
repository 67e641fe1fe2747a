"""Context n-gram lookup ("prompt lookup"): guess that the text repeats itself.

The last n tokens of the context are searched for earlier in the context; the tokens that
followed each earlier occurrence are candidate continuations. Longer matches are more
specific, so n runs from `max_n` down to `min_n`, and within one n candidates are ranked by
how often they followed the match, then by how recently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from drafting.base import Draft


@dataclass
class ContextNgramDrafter:
    """Proposes continuations that followed earlier occurrences of the context's suffix."""

    max_n: int = 4
    min_n: int = 1
    name: str = "context"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, context: Sequence[int], k: int, w: int) -> list[Draft]:
        if k <= 0 or w <= 0 or len(context) < 2:
            return []
        ids = np.asarray(context, dtype=np.int64)  # [L]
        found: list[tuple[int, ...]] = []
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            for continuation in _ranked_continuations(ids, n, w):
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == k:
                        return [Draft(c, self.name) for c in found]
        return [Draft(c, self.name) for c in found]


def _ranked_continuations(ids: np.ndarray, n: int, w: int) -> list[tuple[int, ...]]:
    """Continuations (≤ w tokens) of earlier occurrences of the last n ids, best first.

    Best = followed the suffix most often; ties go to the most recent occurrence.
    """
    suffix = ids[-n:]  # [n]
    windows = sliding_window_view(ids[:-1], n)  # [L-n, n]: starts 0..L-n-1, each has a successor
    starts = np.flatnonzero((windows == suffix).all(axis=1))  # [num_matches]
    counts: dict[tuple[int, ...], int] = {}
    last_seen: dict[tuple[int, ...], int] = {}
    for start in starts.tolist():
        continuation = tuple(ids[start + n : start + n + w].tolist())
        counts[continuation] = counts.get(continuation, 0) + 1
        last_seen[continuation] = start
    return sorted(counts, key=lambda c: (counts[c], last_seen[c]), reverse=True)
