"""Learning-free draft strategies: pure functions of token ids (no model code, no engine)."""

from collections.abc import Sequence

from drafting.acceptance import Acceptance
from drafting.base import BatchStrategy, Draft, PassDistributions, Strategy, common_prefix
from drafting.context_ngram import ContextNgram
from drafting.history import TokenHistory
from drafting.logit import LogitHints
from drafting.mixer import MIXED, Mixer, RequestDrafts, ScoredDraft, select
from drafting.model_ngram import ExtendedBigram, ModelBigram, ModelTables, ModelUnigram, TableSlot
from drafting.recycled import PAIR_BITS, Recycled, SuccessorTable, compile_table_kernels, rank_paths
from drafting.suffix import DEFAULT_CAPACITY, Suffix, SuffixIndex

# Model-running strategies (service/model_drafts/draft_model.py) exist only when the server enables
# them.
MODEL_STRATEGY_NAMES = ("self_draft", "draft_model", "self_draft_staged", "draft_model_staged")
STRATEGY_NAMES = (
    "context",
    "extended_bigram",
    "recycled",
    "logit",
    "suffix",
    "unigram",
    "bigram",
    "token_recycling",
    *MODEL_STRATEGY_NAMES,
    MIXED,
)
# selectable alone, never in `mixed`: the Token Recycling baseline, and the one-token table
# strategies the mix has no use for (a bigram guess is the first token of the extended
# bigram's draft of the same rank; the unigram's guesses ignore the context)
STANDALONE_NAMES = ("unigram", "bigram", "token_recycling")


def default_mixer(
    tables: TableSlot | None = None,
    extra: Sequence[Strategy] = (),
    suffix_cache_tokens: int = DEFAULT_CAPACITY,
) -> Mixer:
    """All learning-free strategies over one (possibly still empty) table slot, one successor
    table refreshed by every pass, and an index of `suffix_cache_tokens` recent output tokens
    of all requests; plus `extra` (the model-running drafts the server enabled). Standalone
    (selectable alone, not mixed): Token Recycling (its own table, nothing else), and the
    unigram and bigram, which in the mix cost a third of a row's drafting and scoring and added
    no tokens a pass (docs/benchmarks.md, "The mix's members")."""
    slot = tables or TableSlot()
    recycled = SuccessorTable(fallback=slot, pair_bits=PAIR_BITS)
    baseline = SuccessorTable()
    # 0: no suffix strategy
    suffix = SuffixIndex(suffix_cache_tokens) if suffix_cache_tokens > 0 else None
    strategies = [
        ContextNgram(),
        ExtendedBigram(slot),
        Recycled(recycled),
        LogitHints(recycled),
        *([Suffix(suffix)] if suffix else []),
        *extra,
    ]
    standalone = [ModelUnigram(slot), ModelBigram(slot), Recycled(baseline, name="token_recycling")]
    return Mixer(
        strategies, slot, standalone=standalone, successors=[recycled, baseline], suffix=suffix
    )


__all__ = [
    "MIXED",
    "MODEL_STRATEGY_NAMES",
    "Acceptance",
    "BatchStrategy",
    "STRATEGY_NAMES",
    "ContextNgram",
    "Draft",
    "RequestDrafts",
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
    "compile_table_kernels",
    "rank_paths",
    "Strategy",
    "TableSlot",
    "TokenHistory",
    "common_prefix",
    "default_mixer",
    "select",
]
