"""A request's token ids with an incremental n-gram index, shared by every strategy.

Each token registers, for each n up to `max_n`, the n-gram that ends there; a lookup of the
context's last n tokens is then a dict access, not a scan of the context. Each n-gram keeps
the positions its continuations start at, oldest first, so recency is the order of that list.
The index catches up on the first lookup after new tokens, not as they arrive, so a request
that never drafts (speculation off) never pays for it.
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
        self._indexed = 0  # tokens whose preceding n-grams are in `_follows`
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
        self.token_ids.extend(token_ids)

    def _catch_up(self) -> None:
        """Index the n-grams that gained a successor since the last lookup: those ending at
        each token before the newest."""
        tokens, follows = self.token_ids, self._follows
        for end in range(max(self._indexed, 1), len(tokens)):
            for n in range(1, min(self.max_n, end) + 1):
                follows[tuple(tokens[end - n : end])].append(end)
        self._indexed = len(tokens)

    def continuation_starts(
        self, n: int, most_recent: int, tail: Sequence[int] = ()
    ) -> Sequence[int]:
        """Where continuations of the last n tokens start (≤ `most_recent` newest, oldest first).

        With `tail`, of the last n tokens of history + tail: where the history's text would
        go on if it were followed by `tail` (a draft model's chain, for staged drafting)."""
        context = [*self.token_ids[-self.max_n :], *tail] if tail else self.token_ids
        if not 1 <= n <= min(self.max_n, len(context)):
            return ()
        return self.follows(tuple(context[-n:]), most_recent)

    def follows(self, ngram: tuple[int, ...], most_recent: int) -> Sequence[int]:
        """Where continuations of earlier occurrences of `ngram` start (≤ `most_recent` newest)."""
        if self._indexed < len(self.token_ids):
            self._catch_up()
        return self._follows.get(ngram, [])[-most_recent:]
