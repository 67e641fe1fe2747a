"""A generation request from its validated body to the engine and back: the model and limit
checks, the engine parameters, the grammar, submission, and the collection of a whole answer.
Shared by the wire formats (app/routes/: OpenAI's and Anthropic's), which render the answer."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import ValidationError
from xgrammar import CompiledGrammar

from app.auth import ClientDep, ConcurrencyLimit
from app.choices import Choices, choice_params, submit_all
from app.deps import ConcurrencyDep, MetricsDep, RuntimeDep, SettingsDep
from app.errors import ApiError
from app.generation import Generation, Kind
from app.limits import check_prompt_length
from app.logprobs import LogprobsFormatter
from app.metrics import Metrics
from app.reasoning import ReasoningStream, opened_in_prompt
from app.schemas import (
    ChatCompletionRequest,
    GenerationRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ResponseFormat,
    SpeculationOptions,
)
from app.settings import Settings
from app.tools import ToolUse
from app.trace import RoundTracer
from service.engine.async_engine import QueueFull, RequestHandle, RequestTimeout, ShuttingDown
from service.engine.detokenizer import TextStream
from service.engine.engine import ContextTooLong
from service.engine.params import (
    MIN_TEMPERATURE,
    GenerationParams,
    SamplingParams,
    SpeculationParams,
)
from service.engine.scheduler import DoesNotFit
from service.grammar import GrammarBusy, GrammarError, GrammarSpec
from service.grammar.compiler import ReasoningStart, json_source
from service.runtime import Runtime

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streaming request checks for its client
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer
# "batch": the request runs at idle priority, in the capacity interactive requests leave (the
# batch runner's lines; any client may ask it for its own offline work)
PRIORITY_HEADER = "x-ngrammys-priority"


@dataclass(frozen=True)
class Serving:
    """What a generation route got from the app (app/deps.py) and its caller's identity."""

    runtime: Runtime
    settings: Settings
    metrics: Metrics
    limit: ConcurrencyLimit
    client: str


async def _serving(
    client: ClientDep,
    runtime: RuntimeDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    limit: ConcurrencyDep,
) -> Serving:
    return Serving(runtime, settings, metrics, limit, client)


# a generation route's parts: 401 without a key, 503 while the model loads
ServingDep = Annotated[Serving, Depends(_serving)]


def chat_request(fields: dict[str, Any], param: str) -> ChatCompletionRequest:
    """The chat request another wire format's request translates to; what the chat route
    refuses of it is a 400 naming `param`, the field it came from."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{param}: {where}: {first['msg']}", param=param) from error


def check_model(request: Request, model: str | None) -> None:
    """404 for a request naming a model this server does not serve (none named: its own)."""
    name = request.app.state.model_name
    if model is not None and model != name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{name}`",
            param="model",
            code="model_not_found",
        )


T = TypeVar("T")


async def tokenize_off_loop(
    request: Request, param: str, encode: Callable[..., T], *args: Any
) -> T:
    """Tokenize on a worker thread (a long prompt must not stall the event loop), one at a
    time (a fast tokenizer shared across threads may fail with "Already borrowed")."""
    lock: threading.Lock = request.app.state.tokenizer_lock

    def run() -> T:
        with lock:
            return encode(*args)

    try:
        return await asyncio.to_thread(run)
    except Exception as error:  # the input's fault: a template that refuses the messages, ...
        raise ApiError(400, f"{param}: could not be tokenized: {error}", param=param) from error


def checked_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """Token ids must exist in the model's embedding (its config's vocabulary, which may be
    larger or smaller than the tokenizer's)."""
    if any(not 0 <= i < vocab_size for i in ids):
        raise ApiError(400, f"{param}: token ids must be in [0, {vocab_size})", param=param)
    return ids


def _params(
    body: GenerationRequest,
    serving: Serving,
    max_tokens: int,
    logprobs: int | None,
    tools: ToolUse,
    reasoning: ReasoningStart,
) -> GenerationParams:
    settings = serving.settings
    options = body.speculation or SpeculationOptions()
    k = settings.spec_k if options.k is None else options.k
    w = settings.spec_w if options.w is None else options.w
    try:
        speculation = SpeculationParams(k, w, options.mode or settings.spec_mode)
    except ValueError as error:
        raise ApiError(400, str(error), param="speculation") from error
    grammar = tools.grammar() or _grammar(body.response_format)
    return GenerationParams(
        max_new_tokens=max_tokens,
        speculation=speculation,
        strategy=options.strategy or settings.spec_strategy,
        sampling=_sampling(body, settings, serving.runtime.vocab_size),
        logprobs=logprobs,
        # the reasoning is free: the grammar holds the answer after it
        grammar=None if grammar is None else replace(grammar, reasoning=reasoning),
    )


def _grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    """What `response_format` asks the output to match (None: free text)."""
    if isinstance(response_format, JsonObjectFormat):
        return GrammarSpec("json_object")
    if isinstance(response_format, JsonSchemaFormat):
        return GrammarSpec(
            "json_schema",
            json_source(response_format.json_schema.json_schema),
            field="response_format.json_schema.schema",
        )
    return None


async def _compiled_grammar(
    runtime: Runtime, spec: GrammarSpec, settings: Settings
) -> CompiledGrammar:
    """The request's grammar, compiled off the event loop and the engine within the limits:
    400 naming the field for one it cannot compile (in time), 429 while every compile slot
    stays busy. Shielded: a client gone does not cancel a compile other requests wait for."""
    try:
        return await asyncio.shield(asyncio.wrap_future(runtime.compile_grammar(spec)))
    except GrammarError as error:
        raise ApiError(400, str(error), param=error.field) from error
    except GrammarBusy as error:
        raise ApiError(
            429,
            str(error),
            "rate_limit_exceeded",
            param=error.field,
            headers={"Retry-After": str(settings.retry_after_seconds)},
        ) from error


def _sampling(body: GenerationRequest, settings: Settings, vocab_size: int) -> SamplingParams:
    """The request's sampling controls; their ranges are the schema's, checked already."""
    temperature = settings.default_temperature if body.temperature is None else body.temperature
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # that close to 0 the distribution is the argmax (see MIN_TEMPERATURE)
    return SamplingParams(
        temperature,
        body.top_p or 1.0,
        max(body.top_k or 0, 0),
        body.seed,
        min_p=body.min_p or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=_logit_bias(body.logit_bias or {}, vocab_size),
    )


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """logit_bias keyed by token id; each must exist in the model's embedding, as a prompt's."""
    by_id = {int(token): value for token, value in bias.items()}
    checked_ids(list(by_id), vocab_size, "logit_bias")
    return by_id


async def start(
    kind: Kind,
    body: GenerationRequest,
    request: Request,
    serving: Serving,
    prompt_ids: list[int],
    max_tokens: int,
    prompt_param: str,
    logprobs: int | None,
    tools: ToolUse = ToolUse(),
) -> Choices:
    """Check the request against the model, the server's limits and its grammar, and submit
    its choices to the engine: 4xx/503 as ApiError before anything runs."""
    runtime, settings, limit, client = (
        serving.runtime,
        serving.settings,
        serving.limit,
        serving.client,
    )
    if not prompt_ids:  # e.g. a prompt of control characters the tokenizer drops
        raise ApiError(400, f"{prompt_param}: the prompt holds no tokens", param=prompt_param)
    check_prompt_length(len(prompt_ids), settings, prompt_param)
    reasoning = _reasoning_start(kind, serving, prompt_ids)
    params = _params(body, serving, max_tokens, logprobs, tools, reasoning)
    if request.headers.get(PRIORITY_HEADER) == "batch":
        params = replace(params, priority="batch")
    if params.grammar is not None:
        params = replace(
            params, compiled_grammar=await _compiled_grammar(runtime, params.grammar, settings)
        )
    enabled = runtime.enabled_strategies
    if params.strategy not in enabled:  # a model draft this server was not started with
        raise ApiError(
            400,
            f"strategy {params.strategy!r} is not enabled on this server; enabled: "
            f"{', '.join(enabled)}",
            param="speculation",
        )
    engine_requests = choice_params(params, body.n)
    try:
        for choice in engine_requests:
            runtime.check_fits(len(prompt_ids), choice)
    except ContextTooLong as error:
        raise ApiError(
            400, str(error), param=prompt_param, code="context_length_exceeded"
        ) from error
    except DoesNotFit as error:
        raise ApiError(
            400, str(error), param="max_tokens", code="kv_cache_budget_exceeded"
        ) from error
    limit.acquire(client)  # one slot for the request, whatever its n
    try:
        handles = submit_all(runtime.async_engine, prompt_ids, engine_requests)
    except QueueFull as error:
        limit.release(client)
        raise ApiError(
            429,
            f"the server is busy: {error}; retry shortly",
            "rate_limit_exceeded",
            headers={"Retry-After": str(settings.retry_after_seconds)},
        ) from error
    except ShuttingDown as error:
        limit.release(client)
        raise ApiError(503, str(error), "service_unavailable") from error
    except BaseException:
        limit.release(client)
        raise
    serving.metrics.prompt_tokens.inc(len(prompt_ids))  # once: the choices share the prompt
    return _choices(kind, body, request, serving, handles, logprobs, tools, reasoning)


def _reasoning_start(kind: Kind, serving: Serving, prompt_ids: list[int]) -> ReasoningStart:
    """Where the answer starts with respect to a reasoning section, where the server parses
    reasoning (chat, `--reasoning-parser think`): inside one the chat template opened, or
    before one it may open."""
    if kind != "chat.completion" or serving.settings.reasoning_parser == "none":
        return "none"
    return "opened" if opened_in_prompt(serving.runtime.tokenizer, prompt_ids) else "may_open"


async def collect(choices: Choices, request: Request | None) -> dict[str, Any] | None:
    """The whole response of `choices`, or None if its client left before it was ready (then
    nobody reads an answer; no `request`: no client to watch, as for a background response); an
    engine failure as the ApiError of its status."""
    try:
        body_json = await _collect_while_connected(choices, request)
    except ClientGone:
        choices.finish("aborted")
        return None
    except Exception as error:
        choices.finish(Generation.status_of(error))
        if isinstance(error, RequestTimeout):
            raise ApiError(504, str(error), "timeout", code="timeout") from error
        if isinstance(error, ShuttingDown):
            raise ApiError(503, str(error), "service_unavailable", code="shutting_down") from error
        raise ApiError(500, f"generation failed: {error}", "server_error") from error
    except BaseException:  # cancelled: the client left
        choices.finish("aborted")
        raise
    choices.finish("ok")
    return body_json


def _choices(
    kind: Kind,
    body: GenerationRequest,
    request: Request,
    serving: Serving,
    handles: list[RequestHandle],
    logprobs: int | None,
    tools: ToolUse,
    reasoning: ReasoningStart,
) -> Choices:
    """The request's `body.n` choices, from its engine requests (one, or one per choice), each
    parsing its own answer's tool calls."""
    runtime, options = serving.runtime, body.stream_options
    # what a call's id is made of, with its answer (a replayed conversation keeps its text)
    prompt_digest = hashlib.sha256(array("q", handles[0].prompt_ids).tobytes()).digest()

    traced = body.speculation is not None and body.speculation.trace

    def reasoning_stream() -> ReasoningStream | None:
        return None if reasoning == "none" else ReasoningStream(reasoning == "opened")

    def generation(handle: RequestHandle, **shared: Any) -> Generation:
        return Generation(
            kind,
            request.app.state.model_name,
            runtime.async_engine,
            handle,
            TextStream(runtime.tokenizer, body.stop or []),
            serving.metrics,
            continuous_usage=bool(options and options.continuous_usage_stats),
            logprobs=None
            if logprobs is None
            else LogprobsFormatter(runtime.tokenizer, kind == "chat.completion"),
            tool_calls=tools.output_parser(prompt_digest),
            reasoning=reasoning_stream(),
            tracer=RoundTracer(runtime.tokenizer) if traced else None,
            **shared,
        )

    # its id and creation time are the other choices' too: one response
    first = generation(handles[0])
    generations = [
        first,
        *(generation(h, request_id=first.request_id, created=first.created) for h in handles[1:]),
    ]
    return Choices(
        generations,
        copies=body.n // len(generations),
        include_usage=bool(options and options.include_usage),
        on_finish=lambda: serving.limit.release(serving.client),
    )


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def _collect_while_connected(choices: Choices, request: Request | None) -> dict[str, Any]:
    """The whole response; the request is aborted as soon as its client disconnects (so a
    `curl -m 2` with a large max_tokens does not keep the engine busy for nobody)."""
    if request is None:
        return await choices.collect()
    collecting = asyncio.ensure_future(choices.collect())
    while True:
        done, _ = await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return collecting.result()
        if await request.is_disconnected():
            collecting.cancel()  # the caller's `finish` aborts the engine requests
            raise ClientGone
