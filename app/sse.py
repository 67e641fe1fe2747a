"""Server-sent events: one `data: {chunk}` per round that produced text, then `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from app.generation import Generation, Piece


def event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def stream_events(generation: Generation) -> AsyncIterator[str]:
    """The SSE body of a streamed completion; an engine failure becomes an error event."""
    status = "aborted"  # unless the stream gets to its end: the client left
    try:
        if generation.kind == "chat.completion":
            yield event(generation.chunk(Piece("", []), role=True))
        async for piece in generation.pieces():
            yield event(generation.chunk(piece))
    except Exception as error:  # the stream ends with an error event; the server lives on
        status = generation.status_of(error)
        yield event({"error": generation.error_fields(error)})
        yield event("[DONE]")
        return
    else:
        status = "ok"
    finally:
        generation.finish(status)
    yield event(generation.final_chunk())
    if generation.include_usage:
        yield event(generation.usage_chunk())
    yield event("[DONE]")
