"""OpenAI's Responses API: `POST /v1/responses`, and a stored response's `GET`, `DELETE`,
`GET .../input_items` and `POST .../cancel`.

A request is translated into the chat request it asks for (app/responses_api/), served by the
chat route's parts (app/serving.py), and its answer translated back: a response object, or the
typed event stream. With `store` (the default) the response is kept (app/responses_api/store.py)
for retrieval and for a later turn's `previous_response_id`; with `background` it is answered at
once and runs stored, to be polled or cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from app.auth import client_identity
from app.choices import Choices
from app.errors import ApiError
from app.limits import check_generation_limits
from app.responses_api.events import ResponseEvents
from app.responses_api.input_items import input_items, items_page
from app.responses_api.schemas import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from app.responses_api.store import ResponseStore, StoredResponse
from app.responses_api.translate import (
    ResponseState,
    answer_messages,
    chat_form,
    finish_from_chat,
)
from app.schemas import error_responses, named_event_stream_schema
from app.serving import (
    CLIENT_CLOSED_REQUEST,
    Serving,
    ServingDep,
    check_model,
    collect,
    start,
    tokenize_off_loop,
)
from app.sse import GenerationStream
from app.tools import chat_prompt, tool_use

router = APIRouter(
    prefix="/v1", dependencies=[Depends(client_identity)], responses=error_responses(401)
)
# chat's names of the fields the Responses API names otherwise
FIELD_NAMES = {
    ".function.parameters": ".parameters",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
}


@router.post(
    "/responses",
    response_model=None,
    responses={
        200: {
            "model": ResponseObject,
            "description": "The response; with `stream: true`, its typed server-sent events",
            "content": {
                "text/event-stream": {
                    "schema": named_event_stream_schema(
                        "The Responses API's typed events, each with its sequence_number: "
                        "response.created ... response.completed, .incomplete or .failed"
                    )
                }
            },
        },
        **error_responses(400, 404, 413, 429, 500, 503, 504),
    },
)
async def create_response(
    body: ResponsesRequest, request: Request, serving: ServingDep
) -> Response:
    check_model(request, body.model)
    store: ResponseStore = request.app.state.responses
    try:
        choices, conversation, items = await _start(body, request, serving, store)
    except ApiError as error:
        raise error.renamed(FIELD_NAMES) from error
    state = ResponseState(body, choices.generations[0].model)

    def keep(state: ResponseState) -> None:
        if body.store:
            store.put(StoredResponse(state, conversation + answer_messages(state.output), items))

    if body.stream:
        events = ResponseEvents(choices, state, keep)
        return GenerationStream(choices, events.body(), events.failure)
    if body.background:
        stored = StoredResponse(state, conversation, items)
        stored.task = asyncio.create_task(_in_background(choices, stored, store))
        store.put(stored)
        return JSONResponse(state.as_dict())
    whole = await collect(choices, request)
    if whole is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    finish_from_chat(state, whole, choices.generations[0].cached_prompt_tokens)
    keep(state)
    return JSONResponse(state.as_dict())


async def _start(
    body: ResponsesRequest, request: Request, serving: Serving, store: ResponseStore
) -> tuple[Choices, list[dict[str, Any]], list[dict[str, Any]]]:
    """The request's choices, submitted; the conversation it continues with its input, and
    the input items of both."""
    earlier: list[dict[str, Any]] = []
    earlier_items: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = _stored(store, body.previous_response_id, "previous_response_id")
        if previous.task is not None:
            raise ApiError(
                400,
                "previous_response_id: that response is still running; wait for it",
                param="previous_response_id",
            )
        earlier = previous.conversation
        earlier_items = previous.input_items + previous.state.output
    max_tokens = body.max_output_tokens or serving.settings.max_tokens
    form = chat_form(body, earlier, max_tokens)
    check_generation_limits(form.chat, serving.settings, max_tokens, "max_output_tokens")
    tools = tool_use(form.chat)
    prompt_ids, tools = await tokenize_off_loop(
        request, "input", chat_prompt, serving.runtime.tokenizer, form.chat.messages, tools
    )
    choices = await start(
        "chat.completion", form.chat, request, serving, prompt_ids, max_tokens, "input", None, tools
    )
    return choices, form.conversation, earlier_items + input_items(body)


async def _in_background(choices: Choices, stored: StoredResponse, store: ResponseStore) -> None:
    """Run a background response to its end (or its cancel), keeping its state up to date."""
    state = stored.state
    try:
        whole = await collect(choices, None)
        assert whole is not None  # (only a client, which a background response has not, leaves)
        finish_from_chat(state, whole, choices.generations[0].cached_prompt_tokens)
        stored.conversation = stored.conversation + answer_messages(state.output)
    except ApiError as error:
        state.fail(error.code or error.type, error.message)
    except asyncio.CancelledError:  # cancelled or deleted; `collect` stopped its engine request
        state.status = "cancelled"
    finally:
        stored.task = None
        if state.id in store:
            store.put(stored)  # its size has changed


def _stored(store: ResponseStore, response_id: str, param: str = "response_id") -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(
            404,
            f"{param}: no stored response with id {response_id!r} (responses are kept in memory, "
            "the least recently used dropped first, and a restart forgets them)",
            param=param,
            code="response_not_found",
        )
    return stored


@router.get(
    "/responses/{response_id}", response_model=ResponseObject, responses=error_responses(404)
)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(request.app.state.responses, response_id).state.as_dict()


@router.get(
    "/responses/{response_id}/input_items",
    response_model=InputItemList,
    responses=error_responses(400, 404),
)
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = Query(None, description="the id of the item the page starts after"),
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = Query("desc", description="desc: the last given first"),
    include: list[str] | None = Query(None, description="accepted and ignored"),
) -> dict[str, Any]:
    """What a stored response was given: the conversation it continued and its own input."""
    stored = _stored(request.app.state.responses, response_id)
    return items_page(stored.input_items, after, limit, order)


@router.delete(
    "/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(404)
)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    store: ResponseStore = request.app.state.responses
    stored = _stored(store, response_id)
    store.remove(response_id)
    if stored.task is not None:
        stored.task.cancel()
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post(
    "/responses/{response_id}/cancel",
    response_model=ResponseObject,
    responses=error_responses(400, 404),
)
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Stop a background response; one already ended is answered as it is."""
    stored = _stored(request.app.state.responses, response_id)
    if not stored.state.body.background:
        raise ApiError(400, "only a background response can be cancelled", param="response_id")
    task = stored.task
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return stored.state.as_dict()
