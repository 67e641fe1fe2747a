"""Server-sent events: one `data: {chunk}` per round that produced text, then `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.choices import Choices
from app.generation import Generation


def event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def stream_events(choices: Choices) -> AsyncIterator[str]:
    """The SSE body of a streamed completion; an engine failure becomes an error event."""
    status = "aborted"  # unless the stream gets to its end: the client left
    try:
        async for chunk in choices.chunks():
            yield event(chunk)
    except Exception as error:  # the stream ends with an error event; the server lives on
        status = Generation.status_of(error)
        yield event({"error": Generation.error_fields(error)})
        yield event("[DONE]")
        return
    else:
        status = "ok"
    finally:
        choices.finish(status)
    if choices.include_usage:
        yield event(choices.usage_chunk())
    yield event("[DONE]")


class GenerationStream(StreamingResponse):
    """The SSE response of a request's choices, which ends the request when the response ends.

    `stream_events` cleans up in its `finally`, but only once it has started: a client that
    disconnects before the body's first chunk makes Starlette cancel the response while the
    generator was never entered, so its `finally` never runs, and the request would go on
    decoding for nobody until its deadline (holding its KV row and concurrency slot).
    """

    def __init__(self, choices: Choices) -> None:
        super().__init__(
            stream_events(choices),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.finish("aborted")  # a no-op once the stream got to its end
