"""Learning-free draft strategies: pure functions of token ids (no model code, no engine)."""

from drafting.base import Draft, Strategy
from drafting.context_ngram import ContextNgram
from drafting.history import TokenHistory
from drafting.acceptance import Acceptance
from drafting.mixer import MIXED, DraftSession, Mixer, ScoredDraft, select
from drafting.model_ngram import ExtendedBigram, ModelBigram, ModelTables, ModelUnigram, TableSlot

STRATEGY_NAMES = ("context", "unigram", "bigram", "extended_bigram", MIXED)


def default_mixer(tables: TableSlot | None = None) -> Mixer:
    """All learning-free strategies over one (possibly still empty) table slot."""
    slot = tables or TableSlot()
    return Mixer([ContextNgram(), ModelUnigram(slot), ModelBigram(slot), ExtendedBigram(slot)], slot)


__all__ = [
    "MIXED",
    "Acceptance",
    "STRATEGY_NAMES",
    "ContextNgram",
    "Draft",
    "DraftSession",
    "ExtendedBigram",
    "Mixer",
    "ScoredDraft",
    "ModelBigram",
    "ModelTables",
    "ModelUnigram",
    "Strategy",
    "TableSlot",
    "TokenHistory",
    "default_mixer",
    "select",
]
