"""Learning-free draft strategies: pure functions of token ids (no model code, no engine)."""

from drafting.base import Draft, Drafter
from drafting.context_ngram import ContextNgramDrafter

__all__ = ["ContextNgramDrafter", "Draft", "Drafter"]
