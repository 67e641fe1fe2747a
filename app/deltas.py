"""A streamed chat answer as the parts other wire formats render (Anthropic's Messages,
OpenAI's Responses): reasoning and text deltas, tool calls (each whole, as the chat stream sends
them), and the end with its finish reason and speculation statistics. One choice: those APIs
have no `n`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

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


async def answer_deltas(
    choices: Choices,
) -> AsyncIterator[ReasoningDelta | TextDelta | ToolCallDelta | End]:
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
