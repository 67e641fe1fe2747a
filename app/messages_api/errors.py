"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, the type
named by the HTTP status as Anthropic names it."""

from __future__ import annotations

from typing import Any

from service.engine.async_engine import RequestTimeout

PATH_PREFIX = "/v1/messages"  # the routes whose errors leave in this shape
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # loading or draining (Anthropic's own overload is a 529)
    504: "timeout_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stream_error(error: Exception) -> dict[str, Any]:
    """The `error` event that ends a stream the engine failed."""
    if isinstance(error, RequestTimeout):
        return error_body(504, str(error))
    return error_body(500, f"generation failed: {error}")
