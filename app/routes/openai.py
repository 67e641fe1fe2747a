"""OpenAI-compatible routes: validate, tokenize, submit to the engine, stream or collect."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.errors import ApiError
from app.generation import Generation, Kind
from app.metrics import Metrics
from app.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, SpeculationOptions
from app.settings import Settings
from app.sse import stream_events
from service.async_engine import QueueFull, RequestTimeout, ShuttingDown
from service.config import GenerationParams, SamplingParams, SpeculationParams
from service.detokenizer import TextStream
from service.engine import ContextTooLong
from service.scheduler import DoesNotFit
from service.prompts import chat_prompt_ids
from service.runtime import Runtime

router = APIRouter(prefix="/v1")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streaming request checks for its client
CLIENT_CLOSED_REQUEST = 499


@router.get("/models")
async def models(request: Request) -> dict[str, object]:
    name = request.app.state.model_name
    cards = [] if name is None else [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "ngrammys"}]
    return {"object": "list", "data": cards}


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    runtime = _runtime(request, body)
    for name in ("echo", "logprobs", "suffix"):
        if getattr(body, name):
            raise ApiError(400, f"`{name}` is not supported", param=name)
    tokenizer = runtime.loaded.tokenizer
    if isinstance(body.prompt, str):
        prompt_ids = tokenizer.encode(body.prompt)
    else:
        prompt_ids = _checked_ids(body.prompt, len(tokenizer))
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    return await _respond("text_completion", body, request, runtime, prompt_ids, max_tokens, "prompt")


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    runtime = _runtime(request, body)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = chat_prompt_ids(runtime.loaded.tokenizer, messages)
    max_tokens = body.max_completion_tokens or body.max_tokens or request.app.state.settings.max_tokens
    return await _respond("chat.completion", body, request, runtime, prompt_ids, max_tokens, "messages")


def _runtime(request: Request, body: GenerationRequest) -> Runtime:
    runtime: Runtime | None = request.app.state.runtime
    if runtime is None:
        raise ApiError(503, "the model is still loading; retry when /ready answers 200", "service_unavailable")
    name = request.app.state.model_name
    if body.model is not None and body.model != name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{name}`",
                       param="model", code="model_not_found")
    return runtime


def _checked_ids(ids: list[int], vocab_size: int) -> list[int]:
    if any(not 0 <= i < vocab_size for i in ids):
        raise ApiError(400, f"token ids must be in [0, {vocab_size})", param="prompt")
    return ids


def _params(body: GenerationRequest, settings: Settings, max_tokens: int) -> GenerationParams:
    options = body.speculation or SpeculationOptions()
    k = settings.spec_k if options.k is None else options.k
    w = settings.spec_w if options.w is None else options.w
    try:
        speculation = SpeculationParams(k, w, options.mode or settings.spec_mode)
    except ValueError as error:
        raise ApiError(400, str(error), param="speculation") from error
    temperature = settings.default_temperature if body.temperature is None else body.temperature
    sampling = SamplingParams(temperature, body.top_p or 1.0, max(body.top_k or 0, 0), body.seed)
    return GenerationParams(max_new_tokens=max_tokens, speculation=speculation,
                            strategy=options.strategy or settings.spec_strategy, sampling=sampling)


async def _respond(
    kind: Kind, body: GenerationRequest, request: Request, runtime: Runtime, prompt_ids: list[int],
    max_tokens: int, prompt_param: str,
) -> Response:
    settings: Settings = request.app.state.settings
    params = _params(body, settings, max_tokens)
    try:
        runtime.engine.check_fits(len(prompt_ids), params)
    except ContextTooLong as error:
        raise ApiError(400, str(error), param=prompt_param, code="context_length_exceeded") from error
    except DoesNotFit as error:
        raise ApiError(400, str(error), param="max_tokens", code="kv_cache_budget_exceeded") from error
    try:
        handle = runtime.async_engine.submit(prompt_ids, params)
    except QueueFull as error:
        raise ApiError(429, f"the server is busy: {error}; retry shortly", "rate_limit_exceeded",
                       headers={"Retry-After": str(settings.retry_after_seconds)}) from error
    except ShuttingDown as error:
        raise ApiError(503, str(error), "service_unavailable") from error
    metrics: Metrics = request.app.state.metrics
    metrics.prompt_tokens.inc(len(prompt_ids))
    generation = Generation(
        kind, request.app.state.model_name, runtime.async_engine, handle,
        TextStream(runtime.loaded.tokenizer, body.stop or []), metrics,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
    )
    if body.stream:
        return StreamingResponse(stream_events(generation), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        body_json = await _collect_while_connected(generation, request)
    except ClientGone:
        generation.finish("aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
    except Exception as error:
        generation.finish(generation.status_of(error))
        if isinstance(error, RequestTimeout):
            raise ApiError(504, str(error), "timeout", code="timeout") from error
        if isinstance(error, ShuttingDown):
            raise ApiError(503, str(error), "service_unavailable", code="shutting_down") from error
        raise ApiError(500, f"generation failed: {error}", "server_error") from error
    generation.finish("ok")
    return JSONResponse(body_json)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def _collect_while_connected(generation: Generation, request: Request) -> dict[str, Any]:
    """The whole response; the request is aborted as soon as its client disconnects (so a
    `curl -m 2` with a large max_tokens does not keep the engine busy for nobody)."""
    collecting = asyncio.ensure_future(generation.collect())
    while True:
        done, _ = await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return collecting.result()
        if await request.is_disconnected():
            generation.engine.abort(generation.handle)
            collecting.cancel()
            raise ClientGone
