"""The `speculation.trace` extension: each streamed round's tokens with their sources, the
whole response's rounds, and nothing of it (byte for byte) unless a request asks."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from tests.helpers.http import QUIET, post, serving_ready, sse_events

pytestmark = pytest.mark.slow  # the embedded model: a real text to copy
TEXT = "The ferry to the island ran twice a day, at nine and at three."
COPY_LONG = [{"role": "user", "content": f"Repeat this sentence word for word:\n\n{TEXT}"}]

COPY_CONTEXT = {"mode": "fixed", "k": 4, "w": 6, "strategy": "context"}


@pytest.fixture(scope="module")
def server(embedded):
    settings = Settings(spec_mode="fixed", spec_k=8, spec_w=6, max_tokens=24, **QUIET)
    with serving_ready(create_app(settings, loader=lambda _: embedded)) as base:
        yield base


def stream(base: str, route: str, body: dict) -> list[str]:
    return sse_events(post(base, route, {**body, "stream": True}))


def chunks(events: list[str]) -> list[dict]:
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def streamed_text(chunks_: list[dict]) -> str:
    pieces = []
    for chunk in chunks_:
        for choice in chunk["choices"]:
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def assert_rounds(rounds: list[dict], text: str, completion_tokens: int) -> None:
    """The rounds in order; their tokens are the completion's, their texts its text."""
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    tokens = [token for r in rounds for token in r["tokens"]]
    assert len(tokens) == completion_tokens
    assert "".join(token["text"] for token in tokens) == text
    for r in rounds:
        assert r["committed"] == len(r["tokens"]) >= 1
        drafted = [t for t in r["tokens"] if t["source"] != "model"]
        assert len(drafted) == min(r["accepted"], r["committed"])
        assert r["tokens"][-1]["source"] == "model" or r["committed"] <= r["accepted"]
        assert r["realized_tokens_per_second"] >= 0


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_chunks_without_the_field_are_unchanged(server: str, route: str) -> None:
    """Asked for nothing, or `trace: false`, the stream is the same bytes (but for its id and
    creation time), and a traced stream's text is the same text. (Drafting from the request's
    own context only: the cross-request strategies would draft more the second time, and the
    rounds, hence the chunks, would differ.)"""
    body = {"max_tokens": 16, "speculation": {**COPY_CONTEXT}}
    body |= {"messages": COPY_LONG} if route.startswith("chat") else {"prompt": "1, 2, 3, 4, 5, 6,"}
    plain = stream(server, route, body)
    explicit = stream(
        server, route, {**body, "speculation": {**body["speculation"], "trace": False}}
    )

    def masked(events: list[str]) -> list[str]:
        return [re.sub(r'"(id|created)": ("[^"]*"|\d+)', r'"\1": 0', e) for e in events]

    assert masked(plain) == masked(explicit)
    assert "speculation_trace" not in "".join(plain)
    traced = stream(server, route, {**body, "speculation": {**body["speculation"], "trace": True}})
    assert streamed_text(chunks(traced)) == streamed_text(chunks(plain))


def test_streamed_rounds_of_a_copy_task(server: str) -> None:
    """Copying a text, the context n-gram strategy certainly drafts some of it."""
    body = {
        "messages": COPY_LONG,
        "max_tokens": 24,
        "speculation": {**COPY_CONTEXT, "trace": True},
        "stream_options": {"include_usage": True},
    }
    got = chunks(stream(server, "chat/completions", body))
    rounds = [chunk["speculation_trace"] for chunk in got if "speculation_trace" in chunk]
    usage = got[-1]["usage"]
    assert_rounds(rounds, streamed_text(got), usage["completion_tokens"])
    assert any(t["source"] == "context" for r in rounds for t in r["tokens"])
    assert all(r["forecast_tokens_per_second"] is None for r in rounds)  # fixed mode: no forecast
    assert all(r["k"] <= 4 and r["w"] <= 6 for r in rounds)


def test_a_whole_response_lists_its_rounds(server: str) -> None:
    body = {"messages": COPY_LONG, "max_tokens": 24, "speculation": {**COPY_CONTEXT}}
    plain = post(server, "chat/completions", body).json()
    assert "speculation_trace" not in plain["choices"][0]
    body["speculation"]["trace"] = True
    traced = post(server, "chat/completions", body).json()
    choice = traced["choices"][0]
    assert choice["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert_rounds(
        choice["speculation_trace"],
        choice["message"]["content"],
        traced["usage"]["completion_tokens"],
    )
    assert any(t["source"] == "context" for r in choice["speculation_trace"] for t in r["tokens"])


def test_completions_stream_traces_its_text(server: str) -> None:
    body = {
        "prompt": "one two three one two three one two three",
        "max_tokens": 24,
        "speculation": {**COPY_CONTEXT, "trace": True},
        "stream_options": {"include_usage": True},
    }
    got = chunks(stream(server, "completions", body))
    rounds = [chunk["speculation_trace"] for chunk in got if "speculation_trace" in chunk]
    assert_rounds(rounds, streamed_text(got), got[-1]["usage"]["completion_tokens"])


def test_the_extension_is_in_the_openapi_schema(server: str) -> None:
    schema = httpx.get(f"{server}/openapi.json").json()
    components = schema["components"]["schemas"]
    assert "trace" in components["SpeculationOptions"]["properties"]
    assert "speculation_trace" in components["ChatCompletionChunk"]["properties"]
    assert "speculation_trace" in components["CompletionResponse"]["properties"]
    assert set(components["RoundTrace"]["required"]) >= {"round", "k", "w", "tokens"}
    assert "/v1/speculation/status" in schema["paths"]
