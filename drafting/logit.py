"""Logit hints (LogitSpec-style): the last distribution already names the token after next.

The pass that chose the newest token computed the model's whole distribution at its position;
the runner-up tokens there are good guesses for the token *after* it (LogitSpec, Liu et al.,
2025). Each becomes the first token of a branch, continued by what followed that guess in the
request's own text (context index, longest match first), then by the recycled successor
table. The engine hands the hints over with the pass's distributions (`TokenHistory.hints`);
before the first pass there are none and the strategy proposes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from drafting.base import Draft
from drafting.history import TokenHistory
from drafting.recycled import SuccessorTable


@dataclass(frozen=True)
class LogitHints:
    """Branches that start with the runner-up tokens of the newest token's distribution."""

    table: SuccessorTable
    max_n: int = 4  # longest context match tried for the continuation, the guess included
    name: str = "logit"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        if k <= 0 or w <= 0:
            return []
        guesses = [t for t in history.hints if t != history.last_token][:k]
        if not guesses:  # no hints (a round after a skipped one): nothing to look up
            return []
        tokens = history.token_ids
        # the newest n-1 tokens that a guess completes to a context n-gram, longest first
        contexts = [
            tuple(tokens[len(tokens) - n + 1 :])
            for n in range(min(self.max_n, len(tokens) + 1), 1, -1)
        ]
        found = [self._found(history, contexts, g, w - 1) for g in guesses]
        # then top-1 successors from the newest two tokens of each, all in one walk of the table
        starts = [((history.last_token, g) + text)[-2:] for g, text in zip(guesses, found)]
        tails = self.table.walk(
            starts, np.zeros((len(found), w - 1), dtype=np.int64), [w - 1 - len(t) for t in found]
        )
        return [
            Draft((g, *text, *tail), self.name, rank)
            for rank, (g, text, tail) in enumerate(zip(guesses, found, tails))
        ]

    @staticmethod
    def _found(
        history: TokenHistory, contexts: list[tuple[int, ...]], guess: int, length: int
    ) -> tuple[int, ...]:
        """Up to `length` tokens of the text that followed the newest occurrence of the longest
        matching context + `guess` (none where no context matches). A longer context + guess
        occurs only where the newest token + guess does, and most guesses never followed the
        newest token: that pair is looked up first, one lookup instead of three for them."""
        if (
            length <= 0
            or not contexts
            or not history.follows((*contexts[-1], guess), most_recent=1)
        ):
            return ()
        for context in contexts:
            starts = history.follows((*context, guess), most_recent=1)
            if starts:
                return tuple(history.token_ids[starts[-1] : starts[-1] + length])
        return ()
