"""Structured output: the grammar a request's output must match, compiled once per schema
within bounds (`compiler.py`, `limits.py`, `worker.py`, `bounded.py`) and followed token by
token (`constraint.py`), and drafted where it forces the text (`forced_text.py`)."""

from service.grammar.bounded import BoundedCompiler, GrammarBusy
from service.grammar.compiler import GrammarCompiler, GrammarError, GrammarSpec
from service.grammar.constraint import Constraint
from service.grammar.forced_text import ForcedText
from service.grammar.limits import GrammarLimits
from service.grammar.worker import CompileTimeout

__all__ = [
    "BoundedCompiler",
    "CompileTimeout",
    "Constraint",
    "ForcedText",
    "GrammarBusy",
    "GrammarCompiler",
    "GrammarError",
    "GrammarLimits",
    "GrammarSpec",
]
