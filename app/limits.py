"""The server's limits on a request, each refused with a 4xx in OpenAI's error shape.

The body size is enforced while the body is read (413); the rest are checked on the parsed
request before anything reaches the engine (400). The per-key concurrency limit lives with the
API keys in `app/auth.py` (429).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError
from app.schemas import GenerationRequest
from app.settings import Settings


class BodySizeLimit:
    """ASGI middleware: a body over `limit` bytes fails with 413 as soon as it shows.

    A declared `Content-Length` over the limit fails at the first read; a chunked body fails
    once the bytes received pass it. Raised from `receive`, the error reaches the app's own
    handlers, so it leaves in OpenAI's shape and is counted like any invalid request.
    """

    def __init__(self, app: ASGIApp, limit: int, by_path: dict[str, int] | None = None) -> None:
        """`by_path`: the limits of paths that take more (file uploads)."""
        self.app, self.default, self.by_path = app, limit, by_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.by_path.get(scope["path"], self.default)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"0")
        received = int(declared) if declared.isdigit() else 0

        async def limited_receive() -> Message:
            nonlocal received
            if received > limit:
                raise _too_large(limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
            return message

        await self.app(scope, limited_receive, send)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(
        413, f"the request body is larger than this server's limit of {limit} bytes"
    )


def check_generation_limits(
    body: GenerationRequest,
    settings: Settings,
    max_tokens: int,
    max_tokens_param: str,
    stop_param: str = "stop",
) -> None:
    """400 naming the field (the stop strings' as the request calls them) for a request beyond
    the server's limits (before tokenizing)."""
    # chat's `max_tokens` beside `max_completion_tokens` is not used, but is held to the cap
    # all the same, as the published schema says
    for param, value in ((max_tokens_param, max_tokens), ("max_tokens", body.max_tokens)):
        if value is not None and value > settings.max_tokens_cap:
            raise ApiError(
                400,
                f"{param}: {value} is more than this server allows "
                f"({settings.max_tokens_cap}); ask for fewer",
                param=param,
            )
    if body.n > settings.max_waiting:  # its sampled choices could never all be queued: 429 for ever
        raise ApiError(
            400,
            f"n: each choice is a request to the engine, and this server queues at most "
            f"{settings.max_waiting}; ask for fewer",
            param="n",
        )
    stops = body.stop or []
    if len(stops) > settings.max_stop_sequences:
        raise ApiError(
            400,
            f"{stop_param}: at most {settings.max_stop_sequences} stop sequences",
            param=stop_param,
        )
    if any(len(s) > settings.max_stop_length for s in stops):
        raise ApiError(
            400,
            f"{stop_param}: a stop sequence may have at most {settings.max_stop_length} characters",
            param=stop_param,
        )
    options = body.speculation
    for name, server_max in (("k", settings.spec_k), ("w", settings.spec_w)):
        value = None if options is None else getattr(options, name)
        if value is not None and value > server_max:
            raise ApiError(
                400,
                f"speculation.{name}: {value} is above this server's maximum "
                f"(--spec-{name} {server_max})",
                param=f"speculation.{name}",
            )


def check_prompt_length(num_tokens: int, settings: Settings, param: str) -> None:
    if settings.max_prompt_tokens is not None and num_tokens > settings.max_prompt_tokens:
        raise ApiError(
            400,
            f"{param}: the prompt has {num_tokens} tokens; this server accepts at most "
            f"{settings.max_prompt_tokens}",
            param=param,
            code="context_length_exceeded",
        )
