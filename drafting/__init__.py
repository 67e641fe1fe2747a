"""Learning-free draft strategies: pure functions of token ids (no model code, no engine)."""

from collections.abc import Sequence

from drafting.base import BatchStrategy, Draft, PassDistributions, Strategy, common_prefix
from drafting.context_ngram import ContextNgram
from drafting.history import TokenHistory
from drafting.acceptance import Acceptance
from drafting.mixer import MIXED, DraftSession, Mixer, ScoredDraft, select
from drafting.logit import LogitHints
from drafting.model_ngram import ExtendedBigram, ModelBigram, ModelTables, ModelUnigram, TableSlot
from drafting.recycled import Recycled, SuccessorTable, rank_paths
from drafting.suffix import DEFAULT_CAPACITY, Suffix, SuffixIndex

# Model-running strategies (service/draft_model.py) exist only when the server enables them.
MODEL_STRATEGY_NAMES = ("self_draft", "draft_model", "self_draft_staged", "draft_model_staged")
STRATEGY_NAMES = (
    "context", "unigram", "bigram", "extended_bigram", "recycled", "logit", "suffix", "token_recycling",
    *MODEL_STRATEGY_NAMES, MIXED,
)
STANDALONE_NAMES = ("token_recycling",)  # baselines: selectable alone, never in `mixed`


def default_mixer(
    tables: TableSlot | None = None, extra: Sequence[Strategy] = (), suffix_cache_tokens: int = DEFAULT_CAPACITY
) -> Mixer:
    """All learning-free strategies over one (possibly still empty) table slot, one successor
    table refreshed by every pass, and an index of `suffix_cache_tokens` recent output tokens
    of all requests; plus `extra` (the model-running drafts the server enabled); Token Recycling
    (its own table, nothing else) as a standalone baseline."""
    slot = tables or TableSlot()
    recycled = SuccessorTable(fallback=slot)
    baseline = SuccessorTable()
    suffix = SuffixIndex(suffix_cache_tokens) if suffix_cache_tokens > 0 else None  # 0: no suffix strategy
    strategies = [ContextNgram(), ModelUnigram(slot), ModelBigram(slot), ExtendedBigram(slot),
                  Recycled(recycled), LogitHints(recycled), *([Suffix(suffix)] if suffix else []), *extra]
    return Mixer(strategies, slot, standalone=[Recycled(baseline, name="token_recycling")],
                 successors=[recycled, baseline], suffix=suffix)


__all__ = [
    "MIXED",
    "MODEL_STRATEGY_NAMES",
    "Acceptance",
    "BatchStrategy",
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
    "common_prefix",
    "default_mixer",
    "select",
]
