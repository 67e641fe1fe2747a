"""A streamed response: the chat route's chunks as the Responses API's typed events.

`response.created` and `response.in_progress`; for the text, `response.output_item.added` (a
message), `response.content_part.added`, a `response.output_text.delta` per round,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`; for each
tool call, `response.output_item.added` (a function_call), one
`response.function_call_arguments.delta` holding the whole arguments (the chat stream sends each
call whole), `response.function_call_arguments.done`, `response.output_item.done`; then
`response.completed` (or `response.incomplete`, out of `max_output_tokens`) with the whole
response. An engine failure ends the stream with `response.failed`. Every event carries its
`sequence_number`.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.choices import Choices
from app.deltas import End, answer_deltas, events_of
from app.generation import Generation
from app.responses_api.translate import (
    ResponseState,
    call_item,
    message_item,
    reasoning_item,
    reasoning_part,
)
from app.sse import named_event


class _Items:
    """The output items so far, and the message item whose text is still coming."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._text = ""
        self._thought: dict[str, Any] | None = None  # the reasoning item still coming
        self._thinking = ""

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._thought is None:
            events = self.close()
            self._thought, self._thinking = reasoning_item("", "in_progress"), ""
            self.output.append(self._thought)
            events.append(self._added(self._thought))
        self._thinking += text
        delta = {"type": "response.reasoning_text.delta", **self._at(self._thought), "delta": text}
        return [*events, delta]

    def text(self, text: str) -> list[dict[str, Any]]:
        events = self._close_reasoning()
        if self._message is None:
            self._message, self._text = message_item("", "in_progress"), ""
            self.output.append(self._message)
            part = {"type": "response.content_part.added", **self._where(), "part": _part("")}
            events += [self._added(self._message), part]
        self._text += text
        return [*events, {"type": "response.output_text.delta", **self._where(), "delta": text}]

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        item = call_item(call)
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return [
            *self.close(),
            self._added({**item, "arguments": "", "status": "in_progress"}),
            {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "arguments": item["arguments"],
            },
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item,
            },
        ]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        thought = self._thought
        if thought is None:
            return []
        self._thought = None
        where = self._at(thought)
        thought.update(status="completed", content=[reasoning_part(self._thinking)])
        return [
            {"type": "response.reasoning_text.done", **where, "text": self._thinking},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": thought,
            },
        ]

    def close(self) -> list[dict[str, Any]]:
        """Finish the item whose text was coming."""
        message = self._message
        if message is None:
            return self._close_reasoning()
        where, part = self._where(), _part(self._text)
        self._message = None
        message.update(status="completed", content=[part])
        return [
            {"type": "response.output_text.done", **where, "text": self._text},
            {"type": "response.content_part.done", **where, "part": part},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": message,
            },
        ]

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "response.output_item.added",
            "output_index": len(self.output) - 1,
            "item": dict(item),
        }

    def _where(self) -> dict[str, Any]:
        """Where the coming text goes: its message item and part."""
        assert self._message is not None
        return self._at(self._message)

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class ResponseEvents:
    """A streamed response's events, numbered: its body, and the event that ends it if the
    engine fails. `on_end` gets the state once it is whole (stored by the route when asked)."""

    def __init__(
        self, choices: Choices, state: ResponseState, on_end: Callable[[ResponseState], None]
    ) -> None:
        self.choices, self.state, self.on_end = choices, state, on_end
        self._numbers = itertools.count()

    def _sse(self, payload: dict[str, Any]) -> str:
        return named_event({**payload, "sequence_number": next(self._numbers)})

    async def body(self) -> AsyncIterator[str]:
        state, generation = self.state, self.choices.generations[0]
        yield self._sse({"type": "response.created", "response": state.as_dict()})
        yield self._sse({"type": "response.in_progress", "response": state.as_dict()})
        items = _Items()
        async for part in answer_deltas(self.choices):
            events = events_of(part, items)
            if isinstance(part, End):
                state.finish(
                    items.output,
                    part.finish_reason,
                    len(generation.handle.prompt_ids),
                    generation.cached_prompt_tokens,
                    generation.completion_tokens,
                    part.stats,
                )
            for payload in events:
                yield self._sse(payload)
        self.on_end(state)
        kind = "response.incomplete" if state.status == "incomplete" else "response.completed"
        yield self._sse({"type": kind, "response": state.as_dict()})

    def failure(self, error: Exception) -> list[str]:
        """`response.failed`, with the error, ends a stream the engine failed."""
        fields = Generation.error_fields(error)
        self.state.fail(fields["code"] or fields["type"], fields["message"])
        return [self._sse({"type": "response.failed", "response": self.state.as_dict()})]
