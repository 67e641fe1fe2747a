"""A batch input file: JSONL, one request a line (`custom_id`, `method`, `url`, `body`),
checked whole at upload so that a batch never starts on a file it cannot run. Each body is
checked as its route checks it (its schema, and the model it names); an error names its line
(1-based) and the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from app.errors import ApiError, validation_text
from app.responses_api.schemas import ResponsesRequest
from app.schemas import ChatCompletionRequest, CompletionRequest

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
# the routes a line may ask for, and the schema each checks its body with
ENDPOINTS: dict[Endpoint, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
MAX_LINES = 50_000  # OpenAI's bound on a batch's requests
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_lines(content: bytes, model_name: str) -> list[BatchLine]:
    """The file's requests; a 400 naming the first line that is not one (blank lines are
    skipped, as JSONL readers do)."""
    try:
        text = content.decode()
    except UnicodeDecodeError as error:
        raise _line_error(None, f"the file is not UTF-8 text ({error})") from error
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) == MAX_LINES:
            raise _line_error(number, f"a batch holds at most {MAX_LINES} requests")
        line = _parse_line(number, raw, model_name)
        if line.custom_id in seen:
            raise _line_error(number, f"custom_id {line.custom_id!r} is used by an earlier line")
        seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise _line_error(None, "the file holds no requests")
    return lines


def _parse_line(number: int, raw: str, model_name: str) -> BatchLine:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise _line_error(number, f"not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise _line_error(number, "a line is a JSON object")
    custom_id, method, url, body = (value.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise _line_error(number, f"custom_id: a string of 1 to {MAX_CUSTOM_ID} characters")
    if method != "POST":
        raise _line_error(number, "method: must be POST")
    if url not in ENDPOINTS:
        raise _line_error(number, f"url: must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(body, dict):
        raise _line_error(number, "body: the request, a JSON object")
    unknown = set(value) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise _line_error(number, f"unknown fields: {', '.join(sorted(unknown))}")
    check_body(number, url, body, model_name)
    return BatchLine(custom_id, url, body)


def check_body(number: int, url: str, body: dict[str, Any], model_name: str) -> None:
    """The body as its route checks it before running it: its schema, the model it names, and
    no streaming (a line's answer is one JSON body)."""
    try:
        request = ENDPOINTS[url].model_validate(body)
    except ValidationError as error:
        text, _ = validation_text(error.errors())
        raise _line_error(number, f"body.{text}") from error
    model = getattr(request, "model", None)
    if model is not None and model != model_name:
        raise _line_error(
            number,
            f"body.model: the model `{model}` does not exist; this server serves `{model_name}`",
        )
    if getattr(request, "stream", False):
        raise _line_error(number, "body.stream: a batch line is not streamed")
    if getattr(request, "background", False):
        raise _line_error(number, "body.background: a batch line runs in the batch")


def _line_error(number: int | None, message: str) -> ApiError:
    where = "file" if number is None else f"line {number}"
    return ApiError(400, f"{where}: {message}", param="file", code="invalid_batch_line")
