"""Drafts of what the grammar forces next: the text no other continuation could take.

A strict schema fixes its keys, their quotes and separators, and an enum its one remaining
spelling; the grammar knows that text before the model writes it (xgrammar's jump-forward
string). Tokenized the way the tokenizer spells it, it is a draft the model accepts almost
always, however new the schema: learning-free, like the other strategies. Drafts are still
verified; where the model tokenizes the text otherwise, the draft is simply not accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from drafting import Draft, TokenHistory
from service.grammar.constraint import Constraint

NAME = "grammar"


class ForcedText:
    """One constrained request's draft strategy: at most one draft, the forced text's tokens."""

    name = NAME

    def __init__(self, constraint: Constraint, encode: Callable[[str], Sequence[int]]) -> None:
        self.constraint = constraint
        self.encode = encode

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        if k < 1 or w < 1:
            return []
        text = self.constraint.forced_text()
        with self.constraint.timed():
            tokens = tuple(self.encode(text)[:w]) if text else ()
        return [Draft(tokens, self.name)] if tokens else []
