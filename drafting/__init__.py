"""Learning-free draft strategies: pure functions of token ids (no model code, no engine)."""

from collections.abc import Sequence

from drafting.base import Draft, Strategy, common_prefix
from drafting.context_ngram import ContextNgram
from drafting.history import TokenHistory
from drafting.acceptance import Acceptance
from drafting.mixer import MIXED, DraftSession, Mixer, ScoredDraft, select
from drafting.model_ngram import ExtendedBigram, ModelBigram, ModelTables, ModelUnigram, TableSlot

# Model-running strategies (service/draft_model.py) exist only when the server enables them.
MODEL_STRATEGY_NAMES = ("self_draft", "draft_model", "self_draft_staged", "draft_model_staged")
STRATEGY_NAMES = ("context", "unigram", "bigram", "extended_bigram", *MODEL_STRATEGY_NAMES, MIXED)


def default_mixer(tables: TableSlot | None = None, extra: Sequence[Strategy] = ()) -> Mixer:
    """All learning-free strategies over one (possibly still empty) table slot, plus `extra`
    (the model-running drafts the server enabled)."""
    slot = tables or TableSlot()
    return Mixer([ContextNgram(), ModelUnigram(slot), ModelBigram(slot), ExtendedBigram(slot), *extra], slot)


__all__ = [
    "MIXED",
    "MODEL_STRATEGY_NAMES",
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
    "common_prefix",
    "default_mixer",
    "select",
]
