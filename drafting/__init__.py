"""Learning-free draft strategies: pure functions of token ids (no model code, no engine)."""

from drafting.base import Draft, PassDistributions, Strategy
from drafting.context_ngram import ContextNgram
from drafting.history import TokenHistory
from drafting.acceptance import Acceptance
from drafting.mixer import MIXED, DraftSession, Mixer, ScoredDraft, select
from drafting.logit import LogitHints
from drafting.model_ngram import ExtendedBigram, ModelBigram, ModelTables, ModelUnigram, TableSlot
from drafting.recycled import Recycled, SuccessorTable, rank_paths
from drafting.suffix import DEFAULT_CAPACITY, Suffix, SuffixIndex

STRATEGY_NAMES = (
    "context", "unigram", "bigram", "extended_bigram", "recycled", "logit", "suffix", "token_recycling", MIXED,
)
STANDALONE_NAMES = ("token_recycling",)  # baselines: selectable alone, never in `mixed`


def default_mixer(tables: TableSlot | None = None, suffix_cache_tokens: int = DEFAULT_CAPACITY) -> Mixer:
    """All learning-free strategies over one (possibly still empty) table slot, one successor
    table refreshed by every pass, and an index of `suffix_cache_tokens` recent output tokens
    of all requests; Token Recycling (its own table, nothing else) as a standalone baseline."""
    slot = tables or TableSlot()
    recycled = SuccessorTable(fallback=slot)
    baseline = SuccessorTable()
    suffix = SuffixIndex(suffix_cache_tokens) if suffix_cache_tokens > 0 else None  # 0: no suffix strategy
    strategies = [ContextNgram(), ModelUnigram(slot), ModelBigram(slot), ExtendedBigram(slot),
                  Recycled(recycled), LogitHints(recycled), *([Suffix(suffix)] if suffix else [])]
    return Mixer(strategies, slot, standalone=[Recycled(baseline, name="token_recycling")],
                 successors=[recycled, baseline], suffix=suffix)


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
    "LogitHints",
    "PassDistributions",
    "Recycled",
    "STANDALONE_NAMES",
    "Suffix",
    "SuffixIndex",
    "SuccessorTable",
    "rank_paths",
    "Strategy",
    "TableSlot",
    "TokenHistory",
    "default_mixer",
    "select",
]
