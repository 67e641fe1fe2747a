"""`response_format` through real HTTP on the tiny model behind the embedded tokenizer: its text
is random, yet every finished answer parses and matches the schema, through the openai client,
streamed or not, on both routes; speculation gives plain decoding's answer; schemas the grammar
cannot hold to are a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from app.main import create_app
from app.settings import Settings
from tests.helpers.http import QUIET, assert_openai_error, post, serving_ready

MODEL = "tiny-random-llama"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "rank", "tags", "ok"],
}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
}
SPECULATIONS = [{"mode": "off"}, {"mode": "fixed", "k": 4, "w": 3}, {"mode": "auto"}]


@pytest.fixture(scope="module")
def server(tiny_served):
    settings = Settings(spec_mode="fixed", spec_k=4, spec_w=3, **QUIET)
    with serving_ready(create_app(settings, loader=lambda _: tiny_served)) as base:
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def chat(base: str, stream: bool, **fields) -> tuple[str, str]:
    """The answer's text and finish reason, streamed chunks joined."""
    reply = client(base).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city."}], stream=stream, **fields
    )
    if not stream:
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in reply:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", range(3))
def test_chat_answers_match_the_schema(server, stream, seed) -> None:
    text, finish = chat(
        server, stream, response_format=JSON_SCHEMA, max_tokens=120, temperature=1.0, seed=seed
    )
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_on_completions(server) -> None:
    reply = client(server).completions.create(
        model=MODEL,
        prompt="Data:",
        max_tokens=200,
        temperature=0.8,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice.text.startswith("{")


def test_parsed_by_the_openai_client(server) -> None:
    """The client's own structured-output helper parses the answer into the schema's model."""
    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: str = Field(max_length=12)
        rank: int = Field(ge=1, le=9)

    reply = client(server).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city."}],
        response_format=Place,
        max_tokens=80,
    )
    assert isinstance(reply.choices[0].message.parsed, Place)


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"]
)
def test_speculation_gives_the_plain_answer(server, sampling) -> None:
    answers = {
        json.dumps(s): chat(
            server,
            False,
            response_format=JSON_SCHEMA,
            max_tokens=100,
            extra_body={"speculation": s},
            **sampling,
        )[0]
        for s in SPECULATIONS
    }
    assert len(set(answers.values())) == 1, answers


@pytest.mark.parametrize(
    "response_format, param",
    [
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
            "response_format.json_schema.schema.uniqueItems",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
            "response_format",
        ),
        ({"type": "xml"}, "response_format"),
    ],
)
def test_schemas_the_grammar_cannot_hold_are_refused(server, response_format, param) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    response = post(server, "chat/completions", body)
    assert_openai_error(response, 400, response.json()["error"]["param"])
    assert response.json()["error"]["param"].startswith(param), response.json()


def test_text_format_asks_for_nothing(server) -> None:
    text, _ = chat(server, False, response_format={"type": "text"}, max_tokens=8)
    assert isinstance(text, str)
