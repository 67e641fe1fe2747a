"""Reasoning apart from the answer (`--reasoning-parser think`): the text a model writes between
`<think>` and `</think>` before answering, as DeepSeek-R1, Qwen3 and SmolLM3 do.

The reasoning starts either in the answer (it begins with `<think>`) or in the prompt (the chat
template ended the prompt with `<think>`, so the answer starts inside it), and ends at
`</think>`; the whitespace after it is not part of the answer. Text that may still turn out to
be a tag is held back until the next delta settles it. An answer without reasoning is all
answer; one cut inside its reasoning is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from service.grammar.compiler import REASONING_CLOSE as CLOSE
from service.grammar.compiler import REASONING_OPEN as OPEN

PARSERS = ("none", "think")


def opened_in_prompt(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a reasoning section (its template opened `<think>`)."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


@dataclass(frozen=True)
class Split:
    reasoning: str
    answer: str


class ReasoningStream:
    """One choice's text, delta by delta, as reasoning and answer."""

    def __init__(self, opened: bool) -> None:
        """`opened`: the prompt opened the reasoning (else the answer may open it)."""
        self._state = "reasoning" if opened else "start"
        self._held = ""  # text that may yet be (the start of) a tag

    def push(self, text: str) -> Split:
        text, self._held = self._held + text, ""
        reasoning = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                text, self._state = stripped[len(OPEN) :], "reasoning"
            elif OPEN.startswith(stripped):  # (empty, or a part of the tag)
                self._held = text
                return Split("", "")
            else:
                self._state = "answer"
        if self._state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = _partial_tag(text, CLOSE)
                self._held = text[len(text) - keep :]
                return Split(text[: len(text) - keep], "")
            reasoning, text, self._state = text[:end], text[end + len(CLOSE) :], "after"
        if self._state == "after":  # the whitespace between the reasoning and the answer
            text = text.lstrip()
            if not text:
                return Split(reasoning, "")
            self._state = "answer"
        return Split(reasoning, text)

    def finish(self) -> Split:
        """What was held back, once the text has ended (a tag never completed is text)."""
        held, self._held = self._held, ""
        return Split(held, "") if self._state == "reasoning" else Split("", held.lstrip())


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
