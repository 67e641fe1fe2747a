"""Strategies from tables the model itself yields: unigram, bigram, extended bigram.

`ModelTables` holds, for a model, its most likely tokens with no context (unigram) and, for
every token x, its top next tokens after x alone (bigram, [vocab, K]). The engine computes
them by running the model; here they are plain integer arrays. The N-Grammys observation:
the model's next token is rarely a table's top-1 guess but often within its top-k, so k
parallel guesses pay where the hardware has spare compute.

The tables may not exist yet (they are computed in the background at start); until a
`TableSlot` is filled, these strategies propose nothing. While they are computed the slot holds
the rows done so far: the bigram's rows of the first token ids (a vocabulary's ids run from its
commonest tokens, as BPE merges and SentencePiece scores order them), and a token past them has
no successors yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from drafting.base import Draft
from drafting.history import TokenHistory


@dataclass(frozen=True)
class ModelTables:
    """Model-derived token tables."""

    unigram: np.ndarray  # [num_unigram] token ids, most likely first
    # [rows, top_k] uint32: next-token ids after each token alone, best first, for the token
    # ids below rows (the whole vocabulary once computed)
    bigram: np.ndarray

    @cached_property
    def top_successors(self) -> list[int]:
        """Each token's top-1 bigram successor, as a list: chaining reads one per drafted
        token, and a numpy element read costs several times a list's."""
        return self.bigram[:, 0].tolist()

    def successors(self, token: int, k: int) -> list[int]:
        """The top `k` next tokens after `token` alone, best first (none past the rows)."""
        return self.bigram[token, :k].tolist() if token < len(self.bigram) else []

    def chain(self, token_ids: tuple[int, ...], w: int) -> tuple[int, ...]:
        """Extend `token_ids` to `w` tokens by following each last token's top-1 bigram (fewer
        where a token past the rows ends the chain)."""
        extended, top = list(token_ids), self.top_successors
        while len(extended) < w and extended[-1] < len(top):
            extended.append(top[extended[-1]])
        return tuple(extended)


class TableSlot:
    """Where the tables appear once computed; strategies read it every round."""

    def __init__(self, tables: ModelTables | None = None) -> None:
        self.tables = tables


@dataclass(frozen=True)
class ModelUnigram:
    """The model's most likely tokens regardless of context, one token each."""

    slot: TableSlot
    name: str = "unigram"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        tables = self.slot.tables
        if tables is None or k <= 0 or w <= 0:
            return []
        return [Draft((t,), self.name, rank) for rank, t in enumerate(tables.unigram[:k].tolist())]


@dataclass(frozen=True)
class ModelBigram:
    """The model's top next tokens after the newest token alone, one token each."""

    slot: TableSlot
    name: str = "bigram"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        tables = self.slot.tables
        if tables is None or k <= 0 or w <= 0:
            return []
        return [
            Draft((t,), self.name, rank)
            for rank, t in enumerate(tables.successors(history.last_token, k))
        ]


@dataclass(frozen=True)
class ExtendedBigram:
    """Bigram first guesses, each lengthened to w tokens by chaining top-1 bigrams."""

    slot: TableSlot
    name: str = "extended_bigram"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        tables = self.slot.tables
        if tables is None or k <= 0 or w <= 0:
            return []
        return [
            Draft(tables.chain((t,), w), self.name, rank)
            for rank, t in enumerate(tables.successors(history.last_token, k))
        ]
