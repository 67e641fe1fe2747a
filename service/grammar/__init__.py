"""Structured output: the grammar a request's output must match, compiled once per schema
and followed token by token (`compiler.py`, `constraint.py`)."""

from service.grammar.compiler import GrammarCompiler, GrammarError, GrammarSpec
from service.grammar.constraint import Constraint

__all__ = ["Constraint", "GrammarCompiler", "GrammarError", "GrammarSpec"]
