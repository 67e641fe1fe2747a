"""OpenAI-compatible routes: validate, template, hand to the engine, shape the answer."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from app.errors import ApiError
from app.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ResponseMessage,
    SpeculationOptions,
    Usage,
)
from service.config import GenerationParams, SpeculationParams
from service.engine import ContextTooLong
from service.prompts import chat_prompt_ids
from service.runtime import Runtime

router = APIRouter(prefix="/v1")


def _runtime(request: Request) -> Runtime:
    runtime: Runtime | None = request.app.state.runtime
    if runtime is None:
        raise ApiError(503, "the model is still loading; retry when /ready answers 200",
                       "service_unavailable")
    return runtime


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion:
    runtime = _runtime(request)
    settings = request.app.state.settings
    name = request.app.state.model_name
    if body.model is not None and body.model != name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{name}`",
                       param="model", code="model_not_found")
    if body.stream:
        raise ApiError(400, "stream=true is not supported yet", param="stream")
    if body.temperature:
        raise ApiError(400, "only greedy decoding (temperature 0) is supported yet", param="temperature")
    prompt_ids = chat_prompt_ids(runtime.loaded.tokenizer, [m.model_dump() for m in body.messages])
    options = body.speculation or SpeculationOptions()
    k = settings.spec_k if options.k is None else options.k
    w = settings.spec_w if options.w is None else options.w
    try:
        speculation = SpeculationParams(k, w, options.mode or settings.spec_mode)
    except ValueError as error:
        raise ApiError(400, str(error), param="speculation") from error
    params = GenerationParams(
        max_new_tokens=body.max_completion_tokens or body.max_tokens or settings.max_tokens,
        speculation=speculation,
        strategy=options.strategy or settings.spec_strategy,
    )
    try:
        completion = await runtime.complete(prompt_ids, params)
    except ContextTooLong as error:
        raise ApiError(400, str(error), param="messages", code="context_length_exceeded") from error
    text = runtime.loaded.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=name,
        choices=[ChatChoice(index=0, message=ResponseMessage(content=text),
                            finish_reason=completion.finish_reason)],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(completion.token_ids),
                    total_tokens=len(prompt_ids) + len(completion.token_ids)),
    )
