"""Structured output: the grammar a request's output must match, compiled once per schema
and followed token by token (`compiler.py`, `constraint.py`), and drafted where it forces the text
(`forced_text.py`)."""

from service.grammar.compiler import GrammarCompiler, GrammarError, GrammarSpec
from service.grammar.constraint import Constraint
from service.grammar.forced_text import ForcedText

__all__ = ["Constraint", "ForcedText", "GrammarCompiler", "GrammarError", "GrammarSpec"]
