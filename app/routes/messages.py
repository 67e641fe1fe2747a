"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A message request is translated into the chat request it asks for (app/messages_api/), served
by the chat route's parts (app/serving.py: the same checks, prompt, tool calls, grammar and
speculation), and its answer translated back: a message, or Anthropic's event stream.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.auth import client_identity
from app.deps import RuntimeDep
from app.errors import ApiError
from app.limits import check_generation_limits
from app.messages_api.events import message_events, message_failure
from app.messages_api.schemas import (
    AnthropicError,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TokenCount,
)
from app.messages_api.translate import FIELD_NAMES, ChatForm, chat_form, whole_message
from app.schemas import ERROR_MEANINGS, named_event_stream_schema
from app.serving import (
    CLIENT_CLOSED_REQUEST,
    ServingDep,
    check_model,
    collect,
    start,
    tokenize_off_loop,
)
from app.sse import GenerationStream
from app.tools import ToolUse, chat_prompt, tool_use
from service.runtime import Runtime


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries: each status answers in Anthropic's error shape."""
    return {
        status: {"model": AnthropicError, "description": ERROR_MEANINGS[status]}
        for status in statuses
    }


router = APIRouter(prefix="/v1", dependencies=[Depends(client_identity)], responses=_errors(401))


@router.post(
    "/messages",
    response_model=None,
    responses={
        200: {
            "model": Message,
            "description": "The message; with `stream: true`, Anthropic's server-sent events",
            "content": {
                "text/event-stream": {
                    "schema": named_event_stream_schema(
                        "Anthropic's events: message_start, content_block_start/delta/stop, "
                        "message_delta, message_stop; or error"
                    )
                }
            },
        },
        **_errors(400, 404, 413, 429, 500, 503, 504),
    },
)
async def messages(
    body: MessagesRequest,
    request: Request,
    serving: ServingDep,
) -> Response:
    check_model(request, body.model)
    form = chat_form(body)
    check_generation_limits(
        form.chat, serving.settings, body.max_tokens, "max_tokens", "stop_sequences"
    )
    prompt_ids, tools = await _prompt(request, serving.runtime, form)
    choices = await start(
        "chat.completion",
        form.chat,
        request,
        serving,
        prompt_ids,
        body.max_tokens,
        "messages",
        None,
        tools,
    )
    generation = choices.generations[0]
    message_id, model = "msg_" + generation.request_id, generation.model
    if body.stream:
        events = message_events(choices, message_id, model)
        return GenerationStream(choices, events, message_failure)
    whole = await collect(choices, request)
    if whole is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    stop_string = generation.text_stream.stop_string
    cached = generation.cached_prompt_tokens
    return JSONResponse(whole_message(message_id, model, whole, stop_string, cached))


@router.post("/messages/count_tokens", response_model=TokenCount, responses=_errors(400, 404))
async def count_tokens(
    body: CountTokensRequest, request: Request, runtime: RuntimeDep
) -> dict[str, int]:
    """The prompt's tokens, exactly as `/v1/messages` would prompt the model with the request."""
    check_model(request, body.model)
    prompt_ids, _ = await _prompt(request, runtime, chat_form(body))
    return {"input_tokens": len(prompt_ids)}


async def _prompt(request: Request, runtime: Runtime, form: ChatForm) -> tuple[list[int], ToolUse]:
    """The prompt's token ids (the prefill's after the template's), and the tools' use."""
    try:
        tools = tool_use(form.chat)
    except ApiError as error:
        raise error.renamed(FIELD_NAMES) from error
    tokenizer = runtime.tokenizer
    prompt_ids, tools = await tokenize_off_loop(
        request, "messages", chat_prompt, tokenizer, form.chat.messages, tools
    )
    if form.prefill:
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        prompt_ids += await tokenize_off_loop(request, "messages", encode, form.prefill)
    return prompt_ids, tools
