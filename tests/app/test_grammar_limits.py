"""The bounds on grammar work through real HTTP: a schema too large or nested too deep is a 400
before any compile, one that compiles past the time limit a 400 naming the field (a tool's
schema names `tools`), a repeated schema is compiled once, and a plain request stays fast while
hostile schemas compile beside it."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from tests.helpers.grammar import nested_schema, slow_schema
from tests.helpers.http import MESSAGES, QUIET, assert_openai_error, post, runtime_of, serving

TIMEOUT = 1.0
SCHEMA_PARAM = "response_format.json_schema.schema"


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def ask(base: str, **fields) -> httpx.Response:
    return post(base, "chat/completions", {"messages": MESSAGES, "max_tokens": 8, **fields})


@pytest.fixture(scope="module")
def app(tiny_served):
    settings = Settings(grammar_compile_timeout=TIMEOUT, **QUIET)
    return create_app(settings, loader=lambda _: tiny_served)


@pytest.fixture(scope="module")
def server(app):
    with serving(app) as base:
        assert runtime_of(app).grammars.wait_ready(120)  # its start is no compile's time
        yield base


def test_a_schema_over_the_byte_limit_is_refused_before_compiling(server, app) -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}
    compiles = runtime_of(app).grammars.compiles
    response = ask(server, response_format=schema_format(wide))
    error = assert_openai_error(response, 400, SCHEMA_PARAM)
    assert "bytes" in error["message"] and "--grammar-max-bytes" in error["message"]
    assert runtime_of(app).grammars.compiles == compiles


def test_a_schema_nested_past_the_depth_limit_is_refused_before_compiling(server) -> None:
    response = ask(server, response_format=schema_format(nested_schema(30)))
    error = assert_openai_error(response, 400, SCHEMA_PARAM)
    assert "--grammar-max-depth" in error["message"]


def test_a_compile_past_the_time_limit_is_a_400_naming_the_field(server) -> None:
    began = time.monotonic()
    response = ask(server, response_format=schema_format(slow_schema(8)))
    error = assert_openai_error(response, 400, SCHEMA_PARAM)
    assert "did not compile within 1 s" in error["message"]
    assert time.monotonic() - began < 10 * TIMEOUT  # killed at the limit, not run to the end


def test_a_tool_schema_past_the_time_limit_names_tools(server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": slow_schema(8)}}
    response = ask(server, tools=[tool], tool_choice="required")
    assert_openai_error(response, 400, "tools")


def test_a_repeated_schema_is_compiled_once(server, app) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    compiles = runtime_of(app).grammars.compiles
    for _ in range(3):
        assert ask(server, response_format=schema_format(schema)).status_code == 200
    assert runtime_of(app).grammars.compiles == compiles + 1


@pytest.mark.slow
def test_a_plain_request_stays_fast_while_hostile_schemas_compile(server) -> None:
    """Two clients send new slow schemas back to back (each compiles to its limit, or waits in
    line); a plain request's median latency meanwhile stays within a few times its own."""

    def latency() -> float:
        began = time.perf_counter()
        assert ask(server).status_code == 200
        return time.perf_counter() - began

    ask(server)  # warm
    alone = statistics.median(latency() for _ in range(5))
    stop = threading.Event()

    def hostile(client: int) -> None:
        for n in range(1000):
            if stop.is_set():
                return
            schema = slow_schema(8, salt=1000 * client + n)
            assert ask(server, response_format=schema_format(schema)).status_code in (400, 429)

    clients = [threading.Thread(target=hostile, args=(c,)) for c in range(2)]
    for client in clients:
        client.start()
    time.sleep(TIMEOUT / 2)  # a compile is under way
    busy = statistics.median(latency() for _ in range(10))
    stop.set()
    for client in clients:
        client.join()
    assert busy < 4 * alone + 0.1, (busy, alone)
