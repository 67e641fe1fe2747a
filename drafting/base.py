"""The contract between the engine and every draft strategy.

The engine asks a `Drafter` for up to k guesses of up to w tokens that would follow the
context; it merges them into a token tree and verifies them all in one forward pass. A
strategy never sees the model or the engine, only token ids, so it can be tested on literal
arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Draft:
    """One guessed continuation of the context and the strategy that proposed it."""

    token_ids: tuple[int, ...]
    strategy: str

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a draft holds at least one token")


class Drafter(Protocol):
    """A draft strategy: proposes continuations of `context` (prompt + generated ids)."""

    name: str

    def propose(self, context: Sequence[int], k: int, w: int) -> list[Draft]:
        """Return at most `k` distinct drafts of at most `w` tokens each, best first."""
        ...
