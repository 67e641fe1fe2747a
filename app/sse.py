"""Server-sent events: one `data: {chunk}` per round that produced text, then `[DONE]` (or
another wire format's events, app/messages_api/ and app/responses_api/)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.choices import Choices
from app.generation import Generation


def event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def named_event(payload: dict[str, Any]) -> str:
    """An event named by its payload's `type`, as Anthropic's and the Responses API's streams
    name every event."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


Failure = Callable[[Exception], list[str]]  # the events that end a stream the engine failed


async def chunk_events(choices: Choices) -> AsyncIterator[str]:
    """A streamed completion in OpenAI's shape: its chunks, the usage chunk when asked, `[DONE]`."""
    async for chunk in choices.chunks():
        yield event(chunk)
    if choices.include_usage:
        yield event(choices.usage_chunk())
    yield event("[DONE]")


def chunk_failure(error: Exception) -> list[str]:
    return [event({"error": Generation.error_fields(error)}), event("[DONE]")]


async def ending_request(
    choices: Choices, events: AsyncIterator[str], failure: Failure
) -> AsyncIterator[str]:
    """`events`, a stream's body, ending the request of `choices` when they end (`aborted` if
    the client left first); an engine failure ends the body with `failure`'s events, and the
    server lives on."""
    status = "aborted"
    try:
        async for text in events:
            yield text
        status = "ok"
    except Exception as error:
        status = Generation.status_of(error)
        for text in failure(error):
            yield text
    finally:
        choices.finish(status)


class GenerationStream(StreamingResponse):
    """The SSE response of a request's choices, which ends the request when the response ends.

    `ending_request` cleans up in its `finally`, but only once it has started: a client that
    disconnects before the body's first chunk makes Starlette cancel the response while the
    generator was never entered, so its `finally` never runs, and the request would go on
    decoding for nobody until its deadline (holding its KV row and concurrency slot).
    """

    def __init__(
        self,
        choices: Choices,
        events: AsyncIterator[str] | None = None,
        failure: Failure = chunk_failure,
    ) -> None:
        """`events` and `failure`: the body in another wire format than OpenAI's chunks."""
        super().__init__(
            ending_request(choices, chunk_events(choices) if events is None else events, failure),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.finish("aborted")  # a no-op once the stream got to its end
