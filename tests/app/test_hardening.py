"""Bad input, limits, API keys and load failures, through real HTTP on the tiny model.

Each once-reproducible bug has its regression test here (named after what must hold now);
every refusal must be a 4xx in OpenAI's error shape, and the server must live on.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from app.auth import ApiKeys
from app.background import free_port, serving
from app.main import create_app
from app.openapi import decimals_below
from app.schemas import MAX_N
from app.settings import Settings
from service.model.loader import LoadedModel
from tests.helpers.http import (
    COPY_LONG,
    QUIET,
    Asgi24,
    accepted_draft_tokens,
    assert_engine_idle,
    assert_openai_error,
    post,
    slowed,
    speculating,
    wait_ready,
    wait_until,
)
from tests.helpers.models import make_tiny_model

ROOT = Path(__file__).parents[2]
MESSAGES = [{"role": "user", "content": "Say hi."}]
LIMITS = {
    "max_body_bytes": 4096,
    "max_prompt_tokens": 64,
    "max_tokens_cap": 32,
    "max_tokens": 8,
    "max_stop_sequences": 2,
    "max_stop_length": 16,
    "spec_mode": "fixed",
    "spec_k": 4,
    "spec_w": 3,
}
ROUTES = {"chat/completions": {"messages": MESSAGES}, "completions": {"prompt": "Say hi."}}


@pytest.fixture(scope="module")
def server(tiny_served):
    app = create_app(Settings(**LIMITS, **QUIET), loader=lambda _: tiny_served)
    with serving(app) as base:
        wait_ready(base)
        yield base


def text_of(response: httpx.Response) -> str:
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def invalid_count(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith('ngrammys_requests_total{status="invalid"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_model_without_a_chat_template_answers_chat_with_400_and_completions(
    tiny_served,
) -> None:
    """A base model has no chat: 400 naming the route to use, not a template error; its
    completions serve as usual."""
    tokenizer = copy.deepcopy(tiny_served.tokenizer)
    tokenizer.chat_template = None
    loaded = LoadedModel(tiny_served.model, tokenizer, "base", 0.0, False)
    app = create_app(Settings(**LIMITS, **QUIET), loader=lambda _: loaded)
    with serving(app) as base:
        wait_ready(base)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for extra in ({}, {"tools": [tool]}):
            refused = post(base, "chat/completions", {**ROUTES["chat/completions"], **extra})
            assert_openai_error(refused, 400, "messages")
            assert "no chat template" in refused.json()["error"]["message"]
            assert "/v1/completions" in refused.json()["error"]["message"]
        assert post(base, "completions", ROUTES["completions"]).status_code == 200


# --- the bugs ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_tiny_temperature_samples_greedily_instead_of_nan(server: str, route: str) -> None:
    """temperature 1e-45 used to divide the logits to inf and sample from NaN probabilities."""
    body = {**ROUTES[route], "max_tokens": 12, "seed": 3}
    greedy = post(server, route, {**body, "temperature": 0})
    for tiny in (1e-45, 1e-8, 9e-4):
        response = post(server, route, {**body, "temperature": tiny})
        assert response.status_code == 200 and text_of(response) == text_of(greedy)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 + 1])
def test_seed_outside_a_signed_64_bit_integer_is_400(server: str, route: str, seed: int) -> None:
    """A seed above 2^64 used to pass validation and fail in the engine with a 500."""
    assert_openai_error(post(server, route, {**ROUTES[route], "seed": seed}), 400, "seed")


def test_largest_seed_is_accepted(server: str) -> None:
    assert (
        post(
            server, "completions", {"prompt": "hi", "seed": 2**63 - 1, "temperature": 1}
        ).status_code
        == 200
    )


@pytest.mark.parametrize(
    "route,raw,param",
    [
        ("completions", r'{"prompt": "a\ud800b"}', "prompt"),
        ("completions", r'{"prompt": ["\udfff"]}', "prompt.0"),
        (
            "chat/completions",
            r'{"messages": [{"role": "user", "content": "\ud800"}]}',
            "messages.0.content",
        ),
        (
            "chat/completions",
            r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
            "messages.0.content.0.text",
        ),
        (
            "chat/completions",
            r'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}',
            "stop.0",
        ),
    ],
)
def test_lone_surrogate_is_400_in_openai_shape_and_counted(
    server: str, route: str, raw: str, param: str
) -> None:
    """A lone surrogate used to make the tokenizer raise outside any handler: a plain-text 500."""
    before = invalid_count(server)
    error = assert_openai_error(post(server, route, raw=raw), 400, param)
    assert "surrogate" in error["message"]
    assert invalid_count(server) == before + 1


def test_lone_surrogate_echoed_in_an_error_stays_valid_json(server: str) -> None:
    response = post(server, "completions", raw=r'{"prompt": "hi", "model": "x\ud800"}')
    assert_openai_error(response, 404, "model", "model_not_found")


@pytest.mark.parametrize("raw", ['{"prompt": ', '{"messages": [}', "not json", '{"prompt": "hi",}'])
def test_malformed_json_is_400_without_a_byte_offset_as_param(server: str, raw: str) -> None:
    error = assert_openai_error(post(server, "completions", raw=raw), 400, None, "invalid_json")
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("prompt", ["\u0013", "\u0004\u0006"])
def test_prompt_the_tokenizer_drops_entirely_is_400(server: str, prompt: str) -> None:
    """Found by the fuzzer: control characters tokenize to no tokens; the engine raised (500)."""
    error = assert_openai_error(post(server, "completions", {"prompt": prompt}), 400, "prompt")
    assert "no tokens" in error["message"]


def test_token_ids_are_checked_against_the_models_vocabulary(embedded) -> None:
    """The bound is the model's embedding (config.vocab_size), not len(tokenizer): here the
    model's vocabulary is padded past the tokenizer's, as many checkpoints' are."""
    vocab = len(embedded.tokenizer) + 64
    padded = LoadedModel(
        make_tiny_model(vocab_size=vocab), embedded.tokenizer, "padded", 0.0, False
    )
    with serving(create_app(Settings(**QUIET), loader=lambda _: padded)) as base:
        wait_ready(base)
        assert (
            post(base, "completions", {"prompt": [5, vocab - 1], "max_tokens": 2}).status_code
            == 200
        )
        error = assert_openai_error(
            post(base, "completions", {"prompt": [5, vocab]}), 400, "prompt"
        )
        assert str(vocab) in error["message"]


# (`tools` and `tool_choice` are chat's, refused on completions: tests/app/test_tools.py)
# ignored, it would have answered with one sample, not the likeliest of three
UNSUPPORTED = [("echo", True), ("suffix", "end"), ("functions", [{"name": "f"}]), ("best_of", 3)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field,value", UNSUPPORTED)
def test_unsupported_fields_are_400_naming_the_field_on_both_routes(
    server: str, route: str, field: str, value
) -> None:
    """Chat used to accept and silently ignore tools and response_format."""
    error = assert_openai_error(post(server, route, {**ROUTES[route], field: value}), 400, field)
    assert "not supported" in error["message"]


BAD_CONTROLS = [
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", -3),
    ("presence_penalty", "1"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.2),
    ("repetition_penalty", 1e31),
    ("min_p", 1.5),
    ("min_p", -0.1),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"05": 1}),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": "x"}),
    ("logit_bias", {"5": True}),
    ("logit_bias", [5]),
    ("logit_bias", {"1" * 11: 1}),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field,value", BAD_CONTROLS)
def test_sampling_controls_out_of_range_are_400_naming_the_field(
    server: str, route: str, field: str, value
) -> None:
    assert_openai_error(post(server, route, {**ROUTES[route], field: value}), 400, field)


def test_a_logit_bias_outside_the_models_vocabulary_is_400(server: str, tiny_served) -> None:
    vocab = tiny_served.model.config.vocab_size
    body = {"prompt": "hi", "max_tokens": 2}
    assert (
        post(server, "completions", {**body, "logit_bias": {str(vocab - 1): 5}}).status_code == 200
    )
    error = assert_openai_error(
        post(server, "completions", {**body, "logit_bias": {str(vocab): 5}}), 400, "logit_bias"
    )
    assert str(vocab) in error["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_sampling_controls_at_their_bounds_are_accepted(server: str, route: str) -> None:
    body = {
        **ROUTES[route],
        "max_tokens": 4,
        "frequency_penalty": -2,
        "presence_penalty": 2.0,
        "min_p": 1,
        "repetition_penalty": 1e-3,
        "logit_bias": {"0": -100, "5": 100},
    }
    assert post(server, route, body).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_a_full_logit_bias_forces_its_token(server: str, route: str, tiny_served) -> None:
    token = tiny_served.tokenizer.encode(" hello")[0]
    body = {**ROUTES[route], "max_tokens": 4, "temperature": 1, "logit_bias": {str(token): 100}}
    assert text_of(post(server, route, body)) == tiny_served.tokenizer.decode([token] * 4)


@pytest.mark.parametrize("route", ROUTES)
def test_unsupported_fields_at_their_defaults_are_accepted(server: str, route: str) -> None:
    defaults = {
        "logprobs": False,
        "top_logprobs": 0,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "echo": False,
        "suffix": None,
        "best_of": 1,
        "n": 1,
        "metadata": {"unknown": "ignored"},
    }
    assert post(server, route, {**ROUTES[route], **defaults, "max_tokens": 2}).status_code == 200


def test_tokenization_runs_off_the_event_loop(server: str, tiny_served, monkeypatch) -> None:
    tokenizer = tiny_served.tokenizer
    encode = tokenizer.encode

    def slow_encode(*args, **kwargs):
        time.sleep(2)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    replies: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: replies.append(
            post(server, "completions", {"prompt": "hi", "max_tokens": 2})
        )
    )
    worker.start()
    time.sleep(0.3)  # the request is tokenizing now
    started = time.monotonic()
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert time.monotonic() - started < 1.0  # the loop answered while the tokenizer ran
    worker.join(timeout=30)
    assert replies[0].status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413_in_openai_shape(server: str, chunked: bool) -> None:
    body = json.dumps({"prompt": "x" * 5000}).encode()
    content = iter([body[:1000], body[1000:]]) if chunked else body  # a generator is sent chunked
    response = post(server, "completions", raw=content)  # type: ignore[arg-type]
    error = assert_openai_error(response, 413, None, "request_too_large")
    assert "4096" in error["message"]
    assert httpx.get(f"{server}/health").status_code == 200


# --- limits -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route,extra,param,code",
    [
        (
            "completions",
            {"prompt": "word " * 100},
            "prompt",
            "context_length_exceeded",
        ),  # > 64 prompt tokens
        ("completions", {"prompt": [7] * 65}, "prompt", "context_length_exceeded"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "word " * 100}]},
            "messages",
            "context_length_exceeded",
        ),
        (
            "completions",
            {"max_tokens": 33},
            "max_tokens",
            None,
        ),  # above max_tokens_cap: refused, not clamped
        ("chat/completions", {"max_completion_tokens": 33}, "max_completion_tokens", None),
        ("chat/completions", {"stop": ["a", "b", "c"]}, "stop", None),  # more than 2 stop strings
        ("completions", {"stop": "x" * 17}, "stop", None),  # longer than 16 characters
        (
            "chat/completions",
            {"speculation": {"k": 5}},
            "speculation.k",
            None,
        ),  # above the server's spec_k
        ("completions", {"speculation": {"mode": "auto", "w": 4}}, "speculation.w", None),
    ],
)
def test_requests_beyond_the_limits_are_400(
    server: str, route: str, extra, param: str, code
) -> None:
    assert_openai_error(post(server, route, {**ROUTES[route], **extra}), 400, param, code)


@pytest.mark.parametrize(
    "route,extra",
    [
        ("completions", {"max_tokens": 32}),
        ("chat/completions", {"stop": ["x" * 16, "y"]}),
        ("chat/completions", {"speculation": {"mode": "fixed", "k": 4, "w": 3}}),
    ],
)
def test_requests_at_the_limits_are_served(server: str, route: str, extra) -> None:
    assert post(server, route, {**ROUTES[route], **extra}).status_code == 200


def test_concurrent_requests_per_api_key_beyond_the_limit_get_429(embedded) -> None:
    """The embedded model, whose copy of a text accepts drafts: the limit holds while a request
    speculates."""
    settings = Settings(
        api_keys="key-a,key-b", max_concurrent_per_key=1, retry_after_seconds=2, **QUIET
    )
    app = create_app(settings, loader=lambda _: embedded)
    a, b = ({"Authorization": f"Bearer {key}"} for key in ("key-a", "key-b"))
    long = {"messages": COPY_LONG, "max_tokens": 200, "stream": True}
    with serving(app) as base, slowed(app, 0.05):
        wait_ready(base)
        speculating(app)
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=long, headers=a, timeout=60
        ) as running:
            # kept: a dropped iterator closes the stream (the slot is freed then)
            lines = running.iter_lines()
            next(lines)
            # refused while one speculates
            wait_until(lambda: accepted_draft_tokens(base) > 0, timeout=30)
            refused = post(
                base, "chat/completions", {"messages": MESSAGES, "max_tokens": 2}, headers=a
            )
            assert_openai_error(refused, 429, None, "concurrency_limit_exceeded")
            assert refused.headers["retry-after"] == "2"
            assert (
                post(
                    base, "chat/completions", {"messages": MESSAGES, "max_tokens": 2}, headers=b
                ).status_code
                == 200
            )
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert (
            post(
                base, "chat/completions", {"messages": MESSAGES, "max_tokens": 2}, headers=a
            ).status_code
            == 200
        )
        assert_engine_idle(app)


# --- API keys ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tiny_served, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# team keys\nfile-key\n\n")
    settings = Settings(api_keys="env-key-1, env-key-2", api_key_file=key_file, **QUIET)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        yield base


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong-key", "Basic ZW52LWtleS0xOg==", "Bearer", "env-key-1"]
)
def test_missing_or_wrong_api_key_is_401_in_openai_shape(keyed: str, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    response = post(keyed, "chat/completions", {"messages": MESSAGES}, headers=headers)
    error = assert_openai_error(response, 401, None, "invalid_api_key")
    assert (
        error["type"] == "invalid_request_error"
        and response.headers["www-authenticate"] == "Bearer"
    )
    assert httpx.get(f"{keyed}/v1/models", headers=headers).status_code == 401


@pytest.mark.parametrize("key", ["env-key-1", "env-key-2", "file-key"])
def test_keys_from_the_setting_and_the_file_are_accepted(keyed: str, key: str) -> None:
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=key)
    reply = client.chat.completions.create(
        model="tiny-random-llama", messages=MESSAGES, max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_probes_and_metrics_stay_open(keyed: str) -> None:
    assert httpx.get(f"{keyed}/health").status_code == 200
    assert httpx.get(f"{keyed}/ready").status_code == 200
    assert httpx.get(f"{keyed}/metrics").status_code == 200


def test_metrics_can_require_a_key(tiny_served) -> None:
    settings = Settings(api_keys="k", metrics_auth=True, **QUIET)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        assert_openai_error(httpx.get(f"{base}/metrics"), 401, None, "invalid_api_key")
        assert (
            httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        )
        assert httpx.get(f"{base}/health").status_code == 200


def test_keys_are_kept_only_as_digests() -> None:
    keys = ApiKeys(["secret-1", "secret-2"])
    assert "secret" not in repr(vars(keys))
    assert keys.identify("secret-2") and keys.identify("secret-2") != keys.identify("secret-1")
    assert keys.identify("secret-3") is None and keys.identify("") is None
    assert not ApiKeys([]).enabled


# --- load failures ----------------------------------------------------------------------


def test_serve_exits_nonzero_when_the_model_fails_to_load() -> None:
    """`--model /nonexistent` used to leave a process answering 503 forever."""
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--model",
        "/nonexistent",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--no-model-tables",
        "--no-cost-profile",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "no model at /nonexistent" in done.stderr


def test_a_runtime_that_fails_to_start_fails_ready_and_health(tiny_served, monkeypatch) -> None:
    """A failure building the engine after the model loaded used to leave /ready at "loading"."""

    def broken_start(*args, **kwargs):
        raise RuntimeError("out of device memory")

    monkeypatch.setattr("app.main.Runtime.start", broken_start)
    failed = threading.Event()
    app = create_app(Settings(**QUIET), loader=lambda _: tiny_served, on_load_failure=failed.set)
    with serving(app) as base:
        assert failed.wait(timeout=30)
        ready = httpx.get(f"{base}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "out of device memory" in ready.json()["error"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        busy = post(base, "chat/completions", {"messages": MESSAGES})
        assert_openai_error(busy, 503)


# --- the schema -------------------------------------------------------------------------


def test_openapi_documents_what_the_server_answers(server: str) -> None:
    schema = httpx.get(f"{server}/openapi.json").json()
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path  # validation errors are 400
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        responses = schema["paths"][route]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500", "503", "504"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
        error = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("AnthropicError" if route == "/v1/messages" else "ErrorResponse")
    assert "ChatCompletionChunk" in schema["components"]["schemas"]
    # this server asks for no key: the schema says so
    assert "securitySchemes" not in schema["components"]
    assert not any(
        "security" in op for operations in schema["paths"].values() for op in operations.values()
    )


def test_openapi_asks_for_a_key_where_the_server_does(keyed: str) -> None:
    schema = httpx.get(f"{keyed}/openapi.json").json()
    schemes = schema["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    assert (schemes["APIKeyHeader"]["in"], schemes["APIKeyHeader"]["name"]) == (
        "header",
        "x-api-key",
    )
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        # either scheme
        assert schema["paths"][route]["post"]["security"] == [
            {"HTTPBearer": []},
            {"APIKeyHeader": []},
        ]
    assert not any(
        "security" in op for path in ("/health", "/ready") for op in schema["paths"][path].values()
    )


def test_openapi_states_the_limits_the_server_enforces(server: str, tiny_served) -> None:
    """What a schema-following client sends is never refused for a limit the schema hides."""
    settings = Settings(**LIMITS, **QUIET)
    components = httpx.get(f"{server}/openapi.json").json()["components"]["schemas"]
    chat, completion = components["ChatCompletionRequest"], components["CompletionRequest"]
    integer = lambda field: next(b for b in field["anyOf"] if b.get("type") == "integer")  # noqa: E731
    assert integer(chat["properties"]["max_tokens"]) == {
        "type": "integer",
        "minimum": 1,
        "maximum": settings.max_tokens_cap,
    }
    assert integer(chat["properties"]["seed"])["maximum"] == 2**63 - 1  # exactly, not as a float
    assert (completion["properties"]["n"]["minimum"], completion["properties"]["n"]["maximum"]) == (
        1,
        MAX_N,
    )
    options = components["SpeculationOptions"]
    assert integer(options["properties"]["k"])["maximum"] == settings.spec_k
    strategies = next(b for b in options["properties"]["strategy"]["anyOf"] if "enum" in b)["enum"]
    assert (
        "context" in strategies and "self_draft" not in strategies
    )  # not started with model drafts
    assert {"if", "then"} <= set(chat)  # top_logprobs needs logprobs: true
    prompt = completion["properties"]["prompt"]["anyOf"]
    assert all(b.get("minLength") == 1 or b.get("minItems") == 1 for b in prompt)
    vocab = tiny_served.model.config.vocab_size
    ids = next(b for b in prompt if b.get("items", {}).get("type") == "integer")["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == vocab - 1  # the model loaded
    number = lambda field: next(b for b in field["anyOf"] if b.get("type") == "number")  # noqa: E731
    for request in (chat, completion):
        bias = next(
            b for b in request["properties"]["logit_bias"]["anyOf"] if b.get("type") == "object"
        )
        keys = re.compile(bias["propertyNames"]["pattern"])
        assert keys.search(str(vocab - 1)) and not any(
            keys.search(k) for k in (str(vocab), "07", "-1", "1.0", "")
        )
        assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
        assert (
            number(request["properties"]["presence_penalty"])["minimum"],
            number(request["properties"]["frequency_penalty"])["maximum"],
        ) == (-2, 2)
        repetition = number(request["properties"]["repetition_penalty"])
        assert (repetition["minimum"], repetition["maximum"]) == (1e-30, 1e30)
        min_p = number(request["properties"]["min_p"])
        assert (min_p["minimum"], min_p["maximum"]) == (0, 1)


@pytest.mark.parametrize("bound", [1, 2, 10, 11, 64, 100, 101, 999, 49152, 50257])
def test_the_token_id_pattern_matches_exactly_the_ids_below_the_vocabulary(bound: int) -> None:
    pattern = re.compile(f"^({decimals_below(bound)})$")
    assert [n for n in range(3 * bound + 20) if pattern.search(str(n))] == list(range(bound))
    assert not any(pattern.search(key) for key in ("00", "01", "-0", " 1", "1 ", "+1"))


@pytest.mark.parametrize("asgi_2_4", [False, True], ids=["uvicorn", "asgi-2.4"])
def test_a_stream_whose_client_left_before_its_body_began_is_aborted(
    tiny_served, monkeypatch, asgi_2_4: bool
) -> None:
    """Under ASGI 2.4 the response's first send fails once the client is gone, before the SSE
    body generator was ever entered, so the generator's cleanup never ran: the request went on
    decoding for nobody until its deadline, holding its KV row and its client's concurrency
    slot. (uvicorn speaks 2.3, where the generator happens to start first; both must abort.)"""
    tokenizer = tiny_served.tokenizer
    encode = tokenizer.encode

    def slow_encode(*args, **kwargs):
        time.sleep(0.5)  # the client is gone before the route returns its response
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    app = create_app(Settings(max_concurrent_per_key=1, **QUIET), loader=lambda _: tiny_served)
    with serving(Asgi24(app) if asgi_2_4 else app) as base, slowed(app, 0.2):
        wait_ready(base)
        body = {"prompt": "Count to a thousand.", "max_tokens": 400, "stream": True}
        with pytest.raises(httpx.ReadTimeout):  # sent, then the connection is dropped unread
            httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
        # the route returns after 0.5 s, and a pass after that the request is gone (it would
        # otherwise run its 400 tokens, some 80 s at 0.2 s a pass)
        wait_until(
            lambda: "ngrammys_client_disconnects_total 1.0" in httpx.get(f"{base}/metrics").text,
            timeout=5,
        )
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=5)
        assert httpx.get(f"{base}/health").json()["requests_waiting"] == 0
        # and its concurrency slot is free again (one per client here)
        assert post(base, "completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_a_model_draft_the_server_was_not_started_with_is_a_400(server, route) -> None:
    body = {**ROUTES[route], "max_tokens": 4, "speculation": {"strategy": "self_draft"}}
    error = assert_openai_error(post(server, route, body), 400, param="speculation")
    assert (
        "'self_draft' is not enabled on this server; enabled: context, extended_bigram"
        in error["message"]
    )
