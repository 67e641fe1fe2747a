"""Every error leaves as OpenAI's JSON shape, {"error": {message, type, param, code}}, but
those of Anthropic's Messages routes, which leave in Anthropic's (app/messages_api/errors.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from app.messages_api import errors as messages_errors

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def renamed(self, names: dict[str, str]) -> ApiError:
        """This error with its fields named as another wire format names them (each key of
        `names`, a part of a field's path, replaced by its value in `param` and the message)."""
        param, message = self.param, self.message
        for old, new in names.items():
            param = None if param is None else param.replace(old, new)
            message = message.replace(old, new)
        return ApiError(self.status, message, self.type, param, self.code, self.headers)


def error_response(
    request: Request,
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error body; API requests refused before reaching the engine are counted here."""
    if request.url.path.startswith("/v1/") and request.method == "POST" and status < 500:
        outcome = "rejected" if status in (429, 503) else "invalid"
        request.app.state.metrics.requests.labels(outcome).inc()
    # a lone surrogate echoed back stays valid
    message = message.encode("utf-8", "replace").decode("utf-8")
    if request.url.path.startswith(messages_errors.PATH_PREFIX):
        body = messages_errors.error_body(status, message)
    else:
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(
        request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers
    )


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = _says_most(exc.errors())
    message = str(first.get("msg")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":  # the location is a byte offset, not a field
        position = first.get("loc", ("body", "?"))[-1]
        return error_response(
            request,
            400,
            f"the request body is not valid JSON ({message} at byte {position})",
            "invalid_request_error",
            code="invalid_json",
        )
    text, param = validation_text([first], skip=1)
    return error_response(request, 400, text, "invalid_request_error", param)


def validation_text(errors: list[dict], skip: int = 0) -> tuple[str, str | None]:
    """A pydantic validation's most telling error as a message naming its field, and the field
    (its location past the first `skip` parts: 1 for a request body's `body`)."""
    first = _says_most(errors)
    message = str(first.get("msg")).removeprefix("Value error, ")
    location = [str(part) for part in first.get("loc", ())[skip:] if _is_field(part)]
    param = ".".join(location) or None
    return (f"{param}: {message}" if param else message), param


def _says_most(errors: list[dict]) -> dict:
    """A union reports one error per member: the member whose own check failed says most, then
    one that found its field in the body (a field the body has, not one it lacks: a body of
    chat messages is not a prompt missing), and one whose value was of its member's type first
    (a list of blocks with a wrong block is not a string of the wrong type)."""
    checked = (e for e in errors if e.get("type") == "value_error")
    in_member = [
        e
        for e in errors
        if e.get("type") != "missing" and not all(_is_field(p) for p in e.get("loc", ())[1:])
    ]
    of_its_type = (e for e in in_member if not str(e.get("type")).endswith("_type"))
    return next(checked, None) or next(of_its_type, None) or next(iter(in_member), errors[0])


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _is_field(part: str | int) -> bool:
    """A location part that names a field or an index, not a union member's tag such as
    `str`, `list[int]`, `function-after[...]` or a model's class name."""
    return isinstance(part, int) or (
        part.isidentifier() and part.islower() and part not in _UNION_TAGS
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = "request_too_large" if exc.status_code == 413 else None
    headers = exc.headers
    if exc.status_code == 405:  # Starlette names the methods of one route of the path only
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return error_response(
        request, exc.status_code, str(exc.detail), kind, code=code, headers=headers
    )


def _allowed_methods(request: Request) -> list[str]:
    """The methods every route of the request's path takes (GET and DELETE of one resource are
    two routes), through the routers the app includes."""
    methods: set[str] = set()
    routes = list(request.app.routes)
    while routes:
        route = routes.pop()
        if route.matches(request.scope)[0] == Match.NONE:
            continue
        included = getattr(route, "original_router", None)
        if included is not None:
            routes += included.routes
        else:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request, 500, f"internal error: {type(exc).__name__}", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
