"""A streamed message: the chat route's chunks as Anthropic's server-sent events.

`message_start`; per content block `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, or one
`input_json_delta` holding a tool call's whole input, as the chat stream sends each call whole)
and `content_block_stop`; then `message_delta` (stop reason, output tokens) and `message_stop`.
An engine failure after the stream began ends it with an `error` event, as Anthropic's does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.choices import Choices
from app.deltas import End, answer_deltas, events_of
from app.messages_api.errors import stream_error
from app.messages_api.translate import message_body, message_usage, stop_reason, tool_use_block
from app.sse import named_event


@dataclass
class _Blocks:
    """The content blocks sent so far: their count, and the kind of the open one (its deltas
    may still come: `thinking` or `text`)."""

    count: int = 0
    open: str | None = None

    def text(self, text: str) -> list[dict[str, Any]]:
        return self._extend("text", {"type": "text_delta", "text": text})

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._extend("thinking", {"type": "thinking_delta", "thinking": text})

    def _extend(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            block = empty if kind == "thinking" else {"type": "text", "text": ""}
            events = [*self.close(), self._start(block)]
            self.open = kind
        return [*events, self._delta(delta)]

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        block = tool_use_block(call)
        whole = json.dumps(block["input"], ensure_ascii=False)
        events = [*self.close(), self._start({**block, "input": {}})]
        events.append(self._delta({"type": "input_json_delta", "partial_json": whole}))
        return [*events, *self._stop()]

    def close(self) -> list[dict[str, Any]]:
        """Stop the open block."""
        if self.open is None:
            return []
        self.open = None
        return self._stop()

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        return {"type": "content_block_start", "index": self.count - 1, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.count - 1, "delta": delta}

    def _stop(self) -> list[dict[str, Any]]:
        return [{"type": "content_block_stop", "index": self.count - 1}]


async def message_events(choices: Choices, message_id: str, model: str) -> AsyncIterator[str]:
    """The SSE body of a streamed message (one choice: Messages has no `n`)."""
    generation = choices.generations[0]
    prompt_tokens = len(generation.handle.prompt_ids)
    # what the prefix cache gives is known once the request runs: the last event tells it
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
    start = message_body(message_id, model, [], None, None, usage)
    yield named_event({"type": "message_start", "message": start})
    blocks, end = _Blocks(), End(None, None)
    async for part in answer_deltas(choices):
        for payload in events_of(part, blocks):
            yield named_event(payload)
        if isinstance(part, End):
            end = part
    stop_string = generation.text_stream.stop_string
    reason = stop_reason(end.finish_reason, stop_string)
    last: dict[str, Any] = {
        "type": "message_delta",
        "delta": {
            "stop_reason": reason,
            "stop_sequence": stop_string if reason == "stop_sequence" else None,
        },
        "usage": message_usage(
            prompt_tokens, generation.cached_prompt_tokens, generation.completion_tokens
        ),
    }
    if end.stats:
        last["speculative_decoding_stats"] = end.stats
    yield named_event(last)
    yield named_event({"type": "message_stop"})


def message_failure(error: Exception) -> list[str]:
    """The `error` event that ends a stream the engine failed, as Anthropic's do."""
    return [named_event(stream_error(error))]
