"""A chat answer's tool calls, found in its text, and the text around them that is content.

Two conventions (`app/tools.py` picks one per request): the *generic* one, where the whole
answer is one JSON object, `{"tool_calls": [{"name", "arguments"}, ...]}` or `{"content": "..."}`;
and the Hermes one of templates with tool syntax (Qwen2.5, Hermes, SmolLM3), where calls are
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks in free text.

Streaming and non-streaming answers go through the same `ToolCallStream`, so a client gets the
same content and calls whichever way it asks. Text that could be a call is held back until the
answer ends, then parsed whole; an answer that does not parse (cut by `max_tokens`, or a model
that wrote a malformed call) is content, as it was written.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace
from typing import Any, Literal

ToolFormat = Literal["generic", "hermes"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# a block, or (at the end) one the model ended without its closing tag
_HERMES_BLOCK = re.compile(rf"{re.escape(CALL_OPEN)}(.*?)(?:{re.escape(CALL_CLOSE)}|\Z)", re.DOTALL)
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits, as OpenAI's ids look."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def answer_call_id(seed: bytes, index: int) -> str:
    """The id of an answer's call `index`, of `seed` (the prompt's and the answer's digest): the
    same request answered alike gets the same ids, so a conversation replayed (or sent through
    another route) puts the same text before the model."""
    number = int.from_bytes(hashlib.sha256(seed + index.to_bytes(4, "little")).digest(), "little")
    digits = []
    for _ in range(24):
        number, digit = divmod(number, len(_ID_ALPHABET))
        digits.append(_ID_ALPHABET[digit])
    return "call_" + "".join(digits)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        """The call in a response's `message.tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def as_delta(self, index: int) -> dict[str, Any]:
        """The call, whole, as one streamed part of `delta.tool_calls`."""
        return {"index": index, **self.as_openai()}


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ToolCall]


def _call(value: Any) -> ToolCall | None:
    """`{"name": str, "arguments": object}` as a call (arguments re-serialized: JSON text)."""
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("name"), str)
        or "arguments" not in value
    ):
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))


def parse_generic(text: str) -> Parsed | None:
    """An answer in the generic format, or None if it is not one."""
    try:
        answer = json.loads(text)
    except ValueError:
        return None
    if not isinstance(answer, dict) or not ("content" in answer or "tool_calls" in answer):
        return None
    content, items = answer.get("content", ""), answer.get("tool_calls", [])
    if not isinstance(content, str) or not isinstance(items, list):
        return None
    calls = [_call(item) for item in items]
    return None if None in calls else Parsed(content, calls)  # type: ignore[arg-type]


def parse_hermes(text: str) -> Parsed | None:
    """Hermes `<tool_call>` blocks and the text outside them (stripped), or None if a block is
    not a call."""
    calls = []
    for block in _HERMES_BLOCK.finditer(text):
        try:
            call = _call(json.loads(block.group(1)))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return Parsed(_HERMES_BLOCK.sub("", text).strip(), calls) if calls else None


PARSERS = {"generic": parse_generic, "hermes": parse_hermes}


class ToolCallStream:
    """One choice's answer, text delta by text delta: `push` gives the content that can be sent
    now, `finish` the rest and the calls.

    Generic: the whole answer is JSON, held back to the end. Hermes: content is sent until a
    `<tool_call>` could begin (a partial tag, and the whitespace before it, are held back); from
    the tag on, everything is held back."""

    def __init__(self, format: ToolFormat, id_seed: bytes | None = None) -> None:
        """`id_seed`: the prompt's digest, of which (and of the answer) the calls' ids are made;
        None: random ids."""
        self.format, self.id_seed = format, id_seed
        self._undecided = ""  # content not sent yet: it may begin a tag
        # the text from the first tag on
        self._calls: list[str] | None = [] if format == "generic" else None
        # whitespace between the content and the first tag (content again if no call parses)
        self._dropped = ""

    def push(self, text: str) -> str:
        """The content `text` releases (maybe "")."""
        if self._calls is not None:
            self._calls.append(text)
            return ""
        text = self._undecided + text
        start = text.find(CALL_OPEN)
        if start >= 0:
            content = text[:start].rstrip()
            self._dropped, self._calls, self._undecided = (
                text[len(content) : start],
                [text[start:]],
                "",
            )
            return content
        keep = _undecided_tail(text)
        self._undecided = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> Parsed:
        """The content not sent yet and the calls, once the answer has ended."""
        if self._calls is None:
            return Parsed(self._undecided, [])
        text = "".join(self._calls)
        parsed = PARSERS[self.format](text)
        if parsed is None:
            return Parsed(self._dropped + text, [])
        calls = parsed.calls
        if self.id_seed is not None:
            seed = self.id_seed + text.encode("utf-8", "surrogatepass")
            calls = [replace(call, id=answer_call_id(seed, i)) for i, call in enumerate(calls)]
        return Parsed(self._dropped + parsed.content if parsed.content else "", calls)


def _undecided_tail(text: str) -> int:
    """How many characters at the end of `text` may yet begin a `<tool_call>`: a proper prefix
    of the tag, and the whitespace before it."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), -1, -1):
        if text.endswith(CALL_OPEN[:size]):
            start = len(text) - size
            while start and text[start - 1].isspace():
                start -= 1
            return len(text) - start
    return 0
