"""A request's token ids with an incremental n-gram index, shared by every strategy.

Appending a token registers, for each n up to `max_n`, the n-gram that ends there; a lookup
of the context's last n tokens is then a dict access, not a scan of the context. Each
n-gram keeps the positions its continuations start at, oldest first, so recency is the
order of that list.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence


class TokenHistory:
    """Prompt and generated ids of one request, indexed for context lookup."""

    def __init__(self, token_ids: Iterable[int] = (), max_n: int = 4) -> None:
        self.max_n = max_n
        self.token_ids: list[int] = []
        # n-gram -> positions right after its earlier occurrences (where a continuation starts)
        self._follows: dict[tuple[int, ...], list[int]] = defaultdict(list)
        # the model's likeliest tokens at the newest token's position (from the pass that chose
        # it); beyond the newest token itself they guess the token after it (LogitSpec)
        self.hints: tuple[int, ...] = ()
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def extend(self, token_ids: Iterable[int]) -> None:
        self.hints = ()  # they described the position of the old newest token
        for token in token_ids:
            self._index_suffixes()  # the n-grams ending at the old last token now have a successor
            self.token_ids.append(token)

    def _index_suffixes(self) -> None:
        end = len(self.token_ids)
        for n in range(1, min(self.max_n, end) + 1):
            self._follows[tuple(self.token_ids[end - n :])].append(end)

    def continuation_starts(self, n: int, most_recent: int, tail: Sequence[int] = ()) -> Sequence[int]:
        """Where continuations of the last n tokens start (≤ `most_recent` newest, oldest first).

        With `tail`, of the last n tokens of history + tail: where the history's text would
        go on if it were followed by `tail` (a draft model's chain, for staged drafting)."""
        context = [*self.token_ids[-self.max_n :], *tail] if tail else self.token_ids
        if not 1 <= n <= min(self.max_n, len(context)):
            return ()
        return self.follows(tuple(context[-n:]), most_recent)

    def follows(self, ngram: tuple[int, ...], most_recent: int) -> Sequence[int]:
        """Where continuations of earlier occurrences of `ngram` start (≤ `most_recent` newest)."""
        return self._follows.get(ngram, [])[-most_recent:]
