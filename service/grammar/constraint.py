"""One request's place in its grammar, moved only by the tokens it commits.

The verifier asks at each node of the accepted path, in order, for the token the model chooses
under the grammar (`choose` in `service/engine/verifier.py`), and the constraint accepts it:
so the matcher has consumed exactly the committed output, and no draft ever moves it. Drafts
are cut before the pass where they leave the grammar (`legal_lengths`): tried token by token,
then rolled back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import xgrammar

from drafting import common_prefix


class Constraint:
    """A request's grammar matcher and the mask buffer of its next token."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_ids: Sequence[int]) -> None:
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
        self.stop_ids = frozenset(stop_ids)
        # int32 [1, ceil(vocab / 32)]
        self._bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.seconds = 0.0  # spent in the grammar so far (what structured output adds to a request)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the block's time as the grammar's."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - began

    def take_seconds(self) -> float:
        """The grammar time since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id` if the grammar allows it next; whether it did."""
        with self.timed():
            return self.matcher.accept_token(token_id)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one position's logits ([vocab]) with the tokens the grammar forbids next at
        -inf."""
        with self.timed():
            self.matcher.fill_next_token_bitmask(self._bitmask)
            out = logits.float().clone()[None]  # [1, vocab]
            xgrammar.apply_token_bitmask_inplace(out, self._bitmask.to(out.device))
            return out[0]

    def legal_lengths(self, drafts: Sequence[Sequence[int]]) -> list[int]:
        """How many tokens of each draft, from its first, the grammar allows next (state
        unchanged). Drafts are tried in sorted order, so a prefix several share is tried once:
        the mix's drafts often start alike."""
        with self.timed():
            lengths = [0] * len(drafts)
            path: list[int] = []  # tokens accepted past the committed state, in the matcher
            for index in sorted(range(len(drafts)), key=lambda i: tuple(drafts[i])):
                draft = drafts[index]
                shared = common_prefix(path, draft)
                if len(path) > shared:
                    self.matcher.rollback(len(path) - shared)
                    del path[shared:]
                for token in draft[shared:]:
                    if (path and path[-1] in self.stop_ids) or not self.matcher.accept_token(token):
                        # nothing follows a stop token (xgrammar would warn of a finished matcher)
                        break
                    path.append(token)
                lengths[index] = len(path)  # path is the draft's legal prefix now
            if path:
                self.matcher.rollback(len(path))
            return lengths

    def forced_text(self) -> str:
        """The text the grammar allows alone from here ('' where the model has a choice)."""
        with self.timed():
            return self.matcher.find_jump_forward_string()
