"""The published OpenAPI schema, made to say what this server enforces.

FastAPI generates it from the routes; a client or a schema fuzzer that follows it should never
be refused for a request the schema calls valid. So, from this server's settings: validation
errors leave as 400 in OpenAI's shape (app/errors.py), not 422; the bearer scheme appears
only where a key is asked for; the limits the settings set (max_tokens, stop sequences,
speculation k and w, the strategies enabled, n by the queue's length) are the schema's bounds,
and the model's vocabulary bounds token ids (a prompt's, logit_bias's keys); and stream chunks
get their components.
"""

from __future__ import annotations

from typing import Any, get_args

from fastapi import FastAPI
from pydantic.json_schema import models_json_schema

from app.schemas import MAX_N, MAX_REQUEST_SEED, STREAM_MODELS, logit_bias_schema
from app.settings import Settings, Strategy
from drafting import MODEL_STRATEGY_NAMES

Schema = dict[str, Any]


def finish_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` by one that finishes the generated schema: once before the model
    has loaded, and once more when it has (its vocabulary bounds the token ids of a prompt)."""
    generate = app.openapi
    finished_for: list[int | None] = []  # the vocabulary size the schema was finished for

    def openapi() -> Schema:
        vocab_size = None if app.state.runtime is None else app.state.runtime.vocab_size
        if app.openapi_schema is None or finished_for != [vocab_size]:
            app.openapi_schema = None
            finished_for[:] = [vocab_size]
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            _security_as_configured(
                schema, app.state.api_keys.enabled, app.state.settings.metrics_auth
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            _integer_bounds(schema)
            _limits_as_configured(components, app.state.settings)
            if vocab_size is not None:
                _token_ids_below(components, vocab_size)
            _, definitions = models_json_schema(
                [(m, "serialization") for m in STREAM_MODELS],
                ref_template="#/components/schemas/{model}",
            )
            for name, definition in definitions.get("$defs", {}).items():
                components.setdefault(name, definition)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _integer_bounds(node: Any) -> None:
    """FastAPI writes every bound as a float (`minimum: 1.0`); an integer field's are integers
    (a fuzzer took `max_tokens: 0` for valid against `minimum: 1.0`)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)


def _security_as_configured(schema: Schema, keys: bool, metrics_auth: bool) -> None:
    """The bearer scheme only where this server asks for a key: every route's dependency
    declares it, but without keys nothing is checked (and /metrics only with `metrics_auth`)."""
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            if not keys or (path == "/metrics" and not metrics_auth):
                operation.pop("security", None)
    if not keys:
        schema.get("components", {}).pop("securitySchemes", None)


def enabled_strategies(settings: Settings) -> set[str]:
    """The strategy names a request may ask for on a server started with `settings`."""
    models = {"self_draft"} if settings.self_draft else set()
    if settings.draft_model:
        models.add("draft_model")
    if settings.draft_staged:
        models |= {f"{name}_staged" for name in models}
    return models | {name for name in get_args(Strategy) if name not in MODEL_STRATEGY_NAMES}


def _limits_as_configured(components: Schema, settings: Settings) -> None:
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        properties = components[request]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _bound(properties[field], "integer", maximum=settings.max_tokens_cap)
        # FastAPI's schema holds bounds as floats: 2**63 - 1 would publish as 2**63
        _bound(properties["seed"], "integer", maximum=MAX_REQUEST_SEED)
        # a choice is a request
        _bound(properties["n"], "integer", maximum=min(MAX_N, settings.max_waiting))
        _bound(properties["stop"], "string", maxLength=settings.max_stop_length)
        _bound_stops(properties["stop"], settings)
    messages = components["MessagesRequest"]["properties"]
    _bound(messages["max_tokens"], "integer", maximum=settings.max_tokens_cap)
    _bound_stops(messages["stop_sequences"], settings)
    responses = components["ResponsesRequest"]["properties"]
    _bound(responses["max_output_tokens"], "integer", maximum=settings.max_tokens_cap)
    options = components["SpeculationOptions"]
    speculation = options["properties"]
    _bound(speculation["k"], "integer", maximum=settings.spec_k)
    _bound(speculation["w"], "integer", maximum=settings.spec_w)
    options["allOf"] = _speculation_rules(settings)
    enabled = enabled_strategies(settings)
    for branch in speculation["strategy"]["anyOf"]:
        if "enum" in branch:
            branch["enum"] = [name for name in branch["enum"] if name in enabled]


def _bound_stops(field: Schema, settings: Settings) -> None:
    """A list of stop strings: its count and their lengths."""
    _bound(field, "array", maxItems=settings.max_stop_sequences)
    for branch in field["anyOf"]:
        if branch.get("type") == "array":
            branch["items"]["maxLength"] = settings.max_stop_length


def _token_ids_below(components: Schema, vocab_size: int) -> None:
    """A prompt's token ids, those to detokenize and logit_bias's keys exist in the model's
    embedding."""
    for branch in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if branch.get("type") == "array" and branch["items"].get("type") == "integer":
            branch["items"]["maximum"] = vocab_size - 1
    components["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = vocab_size - 1
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        components[request]["properties"]["logit_bias"] = logit_bias_schema(
            decimals_below(vocab_size)
        )


def decimals_below(bound: int) -> str:
    """A regex (unanchored alternatives) matching exactly the integers in [0, bound), written in
    decimal without leading zeros: a JSON schema can bound an object's keys only by pattern.
    For the top's digits t_1..t_L: `0`, every shorter number, then each prefix t_1..t_(i-1)
    followed by a smaller digit and any L - i digits, and the top itself."""
    top = str(bound - 1)
    branches = ["0"]
    if len(top) > 1:
        branches.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(map(int, top)):
        lowest = 1 if i == 0 else 0
        if digit > lowest:
            branches.append(f"{top[:i]}[{lowest}-{digit - 1}][0-9]{{{len(top) - i - 1}}}")
    branches.append(top)
    return "|".join(dict.fromkeys(branches))


def _speculation_rules(settings: Settings) -> list[Schema]:
    """Speculations of no tokens are refused (w = 0 with k > 0), the server's k and w standing
    in for the ones a request leaves out."""
    w_zero = {"properties": {"w": {"const": 0}}, "required": ["w"]}
    k_zero = {"properties": {"k": {"const": 0}}, "required": ["k"]}
    if not settings.spec_k:
        k_zero = {"properties": {"k": {"anyOf": [{"const": 0}, {"type": "null"}]}}}
    rules = [{"if": w_zero, "then": k_zero}]
    if not settings.spec_w:
        rules.append(
            {
                "if": {"properties": {"k": {"type": "integer", "minimum": 1}}, "required": ["k"]},
                "then": {"properties": {"w": {"type": "integer", "minimum": 1}}, "required": ["w"]},
            }
        )
    return rules


def _bound(field: Schema, kind: str, **bounds: int) -> None:
    """Set `bounds` on the branches of `field` (a nullable one is an anyOf) of type `kind`."""
    for branch in field.get("anyOf", [field]):
        if branch.get("type") == kind:
            branch.update(bounds)
