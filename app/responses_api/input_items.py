"""A response's input items, as `GET /v1/responses/{id}/input_items` lists them: the whole
context the answer was given, each item with an id. A response continuing another
(`previous_response_id`) was given that one's input items and output too, before its own, as
OpenAI lists them."""

from __future__ import annotations

from typing import Any, Literal

from app.errors import ApiError
from app.responses_api.schemas import (
    EasyInputMessage,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    ResponsesRequest,
)
from app.responses_api.translate import new_id

Item = dict[str, Any]


def input_items(body: ResponsesRequest) -> list[Item]:
    """The request's own input as listed items (new ids where the client sent none)."""
    if isinstance(body.input, str):
        return [_message("user", body.input)]
    items: list[Item] = []
    for item in body.input:
        if isinstance(item, EasyInputMessage):
            items.append(_message(item.role, item.content))
        elif isinstance(item, FunctionCallItem):
            fields = item.model_dump(include={"type", "call_id", "name", "arguments"})
            items.append({"id": item.id or new_id("fc"), **fields, "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            items.append(
                {
                    "id": new_id("fco"),
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": item.text(),
                    "status": "completed",
                }
            )
        else:
            items.append({"id": item.id or new_id("rs"), "type": "reasoning", "summary": []})
    return items


def _message(role: str, content: str | list[InputText]) -> Item:
    """An input message: its parts as sent (a string as one part: `output_text` for an
    assistant's, `input_text` for the others')."""
    if isinstance(content, str):
        if role == "assistant":
            parts = [{"type": "output_text", "text": content, "annotations": []}]
        else:
            parts = [{"type": "input_text", "text": content}]
    else:
        parts = [part.model_dump() for part in content]
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": parts,
    }


def items_page(
    items: list[Item], after: str | None, limit: int, order: Literal["asc", "desc"]
) -> dict[str, Any]:
    """A page of `items` in `order` (`desc`: the last given first), after the item `after`
    (a 400 for an id not among them)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ApiError(400, f"after: no input item with id {after!r}", param="after")
        start = ids.index(after) + 1
    page = ordered[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }
