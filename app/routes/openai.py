"""OpenAI-compatible routes: validate, tokenize, submit to the engine, stream or collect."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.auth import client_identity
from app.choices import Choices
from app.limits import check_generation_limits
from app.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    error_responses,
    event_stream_schema,
)
from app.serving import (
    CLIENT_CLOSED_REQUEST,
    ServingDep,
    check_model,
    checked_ids,
    collect,
    start,
    tokenize_off_loop,
)
from app.sse import GenerationStream
from app.tools import chat_prompt, tool_use

router = APIRouter(
    prefix="/v1", dependencies=[Depends(client_identity)], responses=error_responses(401)
)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
GENERATION_ERRORS = error_responses(400, 404, 413, 429, 500, 503, 504)


def _generation_responses(model: type, chunk: type) -> dict[int | str, dict[str, Any]]:
    ok = {
        "model": model,
        "description": "The completion; with `stream: true`, server-sent events of chunks",
        "content": {"text/event-stream": {"schema": event_stream_schema(chunk)}},
    }
    return {200: ok, **GENERATION_ERRORS}


@router.get("/models", response_model=ModelList)
async def models(request: Request) -> dict[str, object]:
    name, runtime = request.app.state.model_name, request.app.state.runtime
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "ngrammys"}
    if runtime is not None:
        card["max_model_len"] = runtime.max_context
    return {"object": "list", "data": [] if name is None else [card]}


@router.post(
    "/completions",
    response_model=None,
    responses=_generation_responses(CompletionResponse, CompletionResponse),
)
async def completions(
    body: CompletionRequest,
    request: Request,
    serving: ServingDep,
) -> Response:
    runtime, settings = serving.runtime, serving.settings
    check_model(request, body.model)
    max_tokens = body.max_tokens or min(COMPLETIONS_DEFAULT_MAX_TOKENS, settings.max_tokens_cap)
    check_generation_limits(body, settings, max_tokens, "max_tokens")
    if isinstance(body.prompt, str):
        prompt_ids = await tokenize_off_loop(
            request, "prompt", runtime.tokenizer.encode, body.prompt
        )
    else:
        prompt_ids = checked_ids(body.prompt, runtime.vocab_size)
    choices = await start(
        "text_completion",
        body,
        request,
        serving,
        prompt_ids,
        max_tokens,
        "prompt",
        body.num_logprobs,
    )
    return await _respond(choices, body.stream, request)


@router.post(
    "/chat/completions",
    response_model=None,
    responses=_generation_responses(ChatCompletionResponse, ChatCompletionChunk),
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    serving: ServingDep,
) -> Response:
    runtime, settings = serving.runtime, serving.settings
    check_model(request, body.model)
    asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens or settings.max_tokens
    check_generation_limits(body, settings, max_tokens, asked)
    tools = tool_use(body)
    prompt_ids, tools = await tokenize_off_loop(
        request, "messages", chat_prompt, runtime.tokenizer, body.messages, tools
    )
    choices = await start(
        "chat.completion",
        body,
        request,
        serving,
        prompt_ids,
        max_tokens,
        "messages",
        body.num_logprobs,
        tools,
    )
    return await _respond(choices, body.stream, request)


async def _respond(choices: Choices, stream: bool, request: Request) -> Response:
    """The submitted request's answer in OpenAI's shape: a stream of chunks, or the whole
    response."""
    if stream:
        return GenerationStream(choices)
    whole = await collect(choices, request)
    if whole is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    return JSONResponse(whole)
