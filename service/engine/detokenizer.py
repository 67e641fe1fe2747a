"""Token ids → text deltas, correct when a round adds several tokens at once.

Two things make naive per-token decoding wrong. A character may span tokens (UTF-8 bytes
of one emoji across two byte-level tokens), so text is only released once it no longer
ends in the replacement character "\ufffd"; and tokenizers merge spaces and prefixes
differently in isolation, so each delta is the difference between decoding a window with
and without the new tokens (the prefix/read offsets of TGI and vLLM).

Stop strings are matched on the text: anything that might be the start of a stop string is
held back until the next delta settles it, so a stop string split across rounds is still
found and never partly sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TextDelta:
    text: str  # safe to send now
    stopped: bool  # a stop string was reached: `text` ends right before it


class TextStream:
    """Incremental detokenization of one completion, with stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._failures = [_failure_function(s) for s in self.stop]
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # end of the text already released from the tokenizer
        self._pending = ""  # decoded but held back (a possible stop-string start)
        self.text = ""  # everything released so far
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once one did

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Add a round's tokens; return the text that can be sent."""
        if self.stopped:
            return TextDelta("", True)
        self._ids.extend(token_ids)
        self._pending += self._decode_new()
        return self._release(final=False)

    def finish(self) -> TextDelta:
        """No more tokens: release whatever was held back (minus a stop string)."""
        if self.stopped:
            return TextDelta("", True)
        self._pending += self._decode_new(final=True)  # an unfinished character shows as "\ufffd"
        return self._release(final=True)

    def _decode_new(self, final: bool = False) -> str:
        decode = self.tokenizer.decode
        before = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        after = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing new, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before) :]

    def _release(self, final: bool) -> TextDelta:
        hits = [(self._pending.find(s), s) for s in self.stop if s in self._pending]
        if hits:
            cut, self.stop_string = min(hits)
            return self._emit(self._pending[:cut], "", stopped=True)
        keep = 0 if final else _longest_stop_prefix_suffix(self._pending, self.stop, self._failures)
        return self._emit(
            self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        )

    def _emit(self, text: str, held: str, stopped: bool = False) -> TextDelta:
        self._pending = held
        self.text += text
        self.stopped = stopped
        return TextDelta(text, stopped)


def _failure_function(pattern: str) -> list[int]:
    """KMP: failure[i] = length of the longest proper prefix of pattern[:i + 1] that is also its
    suffix."""
    failure = [0] * len(pattern)
    matched = 0
    for i in range(1, len(pattern)):
        while matched and pattern[i] != pattern[matched]:
            matched = failure[matched - 1]
        if pattern[i] == pattern[matched]:
            matched += 1
        failure[i] = matched
    return failure


def _longest_stop_prefix_suffix(
    text: str, stops: Sequence[str], failures: Sequence[list[int]] | None = None
) -> int:
    """Length of the longest end of `text` that begins some stop string (shorter than it).

    Runs the KMP automaton of each stop string over the last len(stop) - 1 characters of
    `text`: the state at the end is the answer, in time linear in the stop's length (checking
    every candidate length with `startswith` is quadratic, and the stop strings are the
    client's).
    """
    longest = 0
    for index, stop in enumerate(stops):
        failure = failures[index] if failures is not None else _failure_function(stop)
        matched = 0  # stays < len(stop): the window is one character shorter than the stop
        for char in text[max(len(text) - len(stop) + 1, 0) :]:
            while matched and char != stop[matched]:
                matched = failure[matched - 1]
            if char == stop[matched]:
                matched += 1
        longest = max(longest, matched)
    return longest
