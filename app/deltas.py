"""A streamed chat answer as the parts other wire formats render (Anthropic's Messages,
OpenAI's Responses): reasoning and text deltas, tool calls (each whole, as the chat stream sends
them), and the end with its finish reason and speculation statistics. One choice: those APIs
have no `n`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.choices import Choices


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    call: dict[str, Any]  # chat's tool call: id, type, function {name, arguments}


@dataclass(frozen=True)
class End:
    finish_reason: str | None
    stats: dict[str, Any] | None


async def answer_deltas(choices: Choices) -> AsyncIterator[Part]:
    """The answer's parts as its chunks come; End last (an engine failure raises instead)."""
    finish_reason, stats = None, None
    async for chunk in choices.chunks():
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                yield ReasoningDelta(delta["reasoning_content"])
            if delta.get("content"):
                yield TextDelta(delta["content"])
            for call in delta.get("tool_calls") or []:
                yield ToolCallDelta(call)
            finish_reason = choice.get("finish_reason") or finish_reason
            stats = choice.get("speculative_decoding_stats") or stats
    yield End(finish_reason, stats)


Part = ReasoningDelta | TextDelta | ToolCallDelta | End


class PartEvents(Protocol):
    """A wire format's events for each kind of part, kept in order by its open block or item."""

    def reasoning(self, text: str) -> list[dict[str, Any]]: ...

    def text(self, text: str) -> list[dict[str, Any]]: ...

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]: ...

    def close(self) -> list[dict[str, Any]]: ...


def events_of(part: Part, events: PartEvents) -> list[dict[str, Any]]:
    """The events `events` renders for `part` (for the end: those closing what is open)."""
    if isinstance(part, ReasoningDelta):
        return events.reasoning(part.text)
    if isinstance(part, TextDelta):
        return events.text(part.text)
    if isinstance(part, ToolCallDelta):
        return events.call(part.call)
    return events.close()
