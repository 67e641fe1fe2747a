"""Anthropic's Messages API through the real `anthropic` client (and httpx for the raw events),
against the chat route as the reference: the same conversation gets the same greedy answer,
its tools the same calls, and errors come in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from app.background import serving
from app.main import create_app
from app.settings import Settings
from service.model.prefix_cache import BLOCK_TOKENS
from tests.helpers.http import QUIET, wait_ready
from tests.helpers.tools import CHAT_WEATHER, MESSAGES_WEATHER

KEY = "messages-key"
MODEL = "tiny-random-llama"
CAP = 256
QUESTION = [{"role": "user", "content": "List the first five prime numbers."}]


@pytest.fixture(scope="module")
def server(tiny_served):
    settings = Settings(api_keys=KEY, max_tokens=CAP, max_tokens_cap=CAP, **QUIET)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def chat(server: str, body: dict) -> dict:
    """The chat route's answer, the reference."""
    reply = httpx.post(
        f"{server}/v1/chat/completions",
        json={"max_tokens": 16, **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def raw_events(server: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed message's (event name, payload) pairs, checking each event's framing."""
    with httpx.stream(
        "POST", f"{server}/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = reply.read().decode()
    events = []
    for block in text.strip("\n").split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append((payload["type"], payload))
    return events


def prompt_of(usage: anthropic.types.Usage) -> int:
    """The prompt's tokens: those computed and those the prefix cache gave."""
    return usage.input_tokens + usage.cache_read_input_tokens


def test_a_message_is_the_chat_routes_answer_to_the_same_conversation(server, client) -> None:
    reference = chat(server, {"messages": QUESTION})
    message = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == reference["choices"][0]["message"]["content"]
    assert (
        message.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[reference["choices"][0]["finish_reason"]]
    )
    prompt_tokens = reference["usage"]["prompt_tokens"]
    assert prompt_of(message.usage) == prompt_tokens
    # the chat route computed the same prompt: its whole blocks came from the prefix cache
    assert message.usage.cache_read_input_tokens >= prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS > 0
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.output_tokens == reference["usage"]["completion_tokens"]
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert counted.input_tokens == prompt_tokens


def test_the_system_prompt_and_turns_map_to_chat_messages(server, client) -> None:
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Name a color.", "cache_control": {"type": "ephemeral"}}
            ],
        },
    ]
    reference = chat(
        server,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi! How can I help?"},
                {"role": "user", "content": "Name a color."},
            ]
        },
    )
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    message = client.messages.create(model=MODEL, max_tokens=16, system=system, messages=turns)
    assert message.content[0].text == reference["choices"][0]["message"]["content"]
    assert prompt_of(message.usage) == reference["usage"]["prompt_tokens"]


def test_a_stream_sends_anthropics_events_and_the_same_text(server, client) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION)
    events = raw_events(server, {"model": MODEL, "max_tokens": 16, "messages": QUESTION})
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    # the start counts the whole prompt; the end what the prefix cache gave of it
    assert start["content"] == [] and start["usage"]["input_tokens"] == prompt_of(whole.usage)
    text = "".join(p["delta"]["text"] for name, p in events if name == "content_block_delta")
    assert text == whole.content[0].text
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == whole.stop_reason
    assert end["usage"] == whole.usage.model_dump(exclude_none=True)
    with client.messages.stream(model=MODEL, max_tokens=16, messages=QUESTION) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage == whole.usage


def test_a_stop_sequence_ends_the_message_and_is_named(client) -> None:
    free = client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION).content[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3
    message = client.messages.create(
        model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=["\x00never", stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == free[: free.index(stop)]


def test_tool_use_blocks_are_the_chat_routes_calls_and_results_go_back(server, client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reference = chat(
        server,
        {
            "messages": ask,
            "tools": [CHAT_WEATHER],
            "tool_choice": "required",
            "max_tokens": CAP,
        },
    )["choices"][0]
    message = client.messages.create(
        model=MODEL,
        max_tokens=CAP,
        messages=ask,
        tools=[MESSAGES_WEATHER],
        tool_choice={"type": "any"},
    )
    calls = [block for block in message.content if block.type == "tool_use"]
    assert (
        message.stop_reason == "tool_use" == {"tool_calls": "tool_use"}[reference["finish_reason"]]
    )
    assert [(c.name, c.input) for c in calls] == [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in reference["message"]["tool_calls"]
    ]
    assert all(c.id for c in calls) and isinstance(calls[0].input["city"], str)
    with client.messages.stream(
        model=MODEL,
        max_tokens=CAP,
        messages=ask,
        tools=[MESSAGES_WEATHER],
        tool_choice={"type": "any"},
    ) as stream:
        final = stream.get_final_message()
    # the same calls, with the same ids: an id is made of the prompt and the answer
    assert [(b.type, b.id, b.name, b.input) for b in final.content] == [
        (b.type, b.id, b.name, b.input) for b in message.content
    ]
    answered = [
        *ask,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": "Sunny, 21 °C"}
                for c in calls
            ],
        },
    ]
    reply = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=answered,
        tools=[MESSAGES_WEATHER],
        tool_choice={"type": "none"},
    )
    assert reply.content[0].type == "text"


def test_a_final_assistant_turn_is_continued(server, client) -> None:
    prefill = "The first five primes are"
    turns = [*QUESTION, {"role": "assistant", "content": prefill}]
    counted = client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    tokenized = httpx.post(
        f"{server}/tokenize", json={"messages": QUESTION}, headers={"x-api-key": KEY}
    ).json()["tokens"]
    prompt = tokenized + client_tokens(server, prefill)
    assert counted == len(prompt)
    message = client.messages.create(model=MODEL, max_tokens=12, messages=turns)
    completion = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": prompt, "max_tokens": 12},
        headers={"x-api-key": KEY},
        timeout=60,
    ).json()
    assert message.content[0].text == completion["choices"][0]["text"]


def client_tokens(server: str, text: str) -> list[int]:
    reply = httpx.post(
        f"{server}/tokenize",
        json={"prompt": text, "add_special_tokens": False},
        headers={"x-api-key": KEY},
    )
    return reply.json()["tokens"]


def test_speculation_is_asked_for_and_reported_as_on_chat(client) -> None:
    plain = client.messages.create(
        model=MODEL, max_tokens=24, messages=QUESTION, extra_body={"speculation": {"mode": "off"}}
    )
    fixed = client.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=QUESTION,
        extra_body={"speculation": {"mode": "fixed", "k": 2, "w": 4}},
    )
    assert fixed.content[0].text == plain.content[0].text
    stats = fixed.model_extra["speculative_decoding_stats"]
    assert stats["num_spec_steps"] > 0 and stats["k"] == 2 and stats["w"] == 4


def error_of(response: httpx.Response, status: int, kind: str) -> str:
    """`response` is an Anthropic error of `status` and `kind`; its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_errors_come_in_anthropics_shape(server, client) -> None:
    url = f"{server}/v1/messages"
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION}
    assert "x-api-key" in error_of(httpx.post(url, json=body), 401, "authentication_error")
    wrong = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    error_of(wrong, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**body)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(**{**body, "model": "claude-opus"})
    assert unknown.value.body["error"]["type"] == "not_found_error"
    headers = {"x-api-key": KEY}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    cases = [
        ({**body, "max_tokens": CAP + 1}, "max_tokens"),
        ({**body, "messages": [{"role": "user", "content": [image]}]}, "messages.0.content.0"),
        ({**body, "stop_sequences": ["x" * 10_000]}, "stop_sequences"),
        ({**body, "temperature": 1.5}, "temperature"),
        (
            {**body, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [MESSAGES_WEATHER]},
            "tool_choice",
        ),
        (
            {**body, "tools": [{**MESSAGES_WEATHER, "input_schema": {"type": "nonsense"}}]},
            "tools",
        ),
        (
            {**body, "tools": [{**MESSAGES_WEATHER, "input_schema": {"allOf": [{}, {}]}}]},
            "tools.0.input_schema.allOf",
        ),
        ({k: v for k, v in body.items() if k != "max_tokens"}, "max_tokens"),
        (
            {
                **body,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}],
                    }
                ],
            },
            "messages.0",
        ),
    ]
    for request, field in cases:
        message = error_of(
            httpx.post(url, json=request, headers=headers), 400, "invalid_request_error"
        )
        assert message.startswith(field), (field, message)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{**body, "max_tokens": CAP + 1})
    count = httpx.post(
        f"{url}/count_tokens", json={"model": MODEL, "messages": []}, headers=headers
    )
    error_of(count, 400, "invalid_request_error")


def test_an_engine_failure_is_an_api_error_and_ends_a_stream_with_an_error_event(
    tiny_served,
) -> None:
    app = create_app(Settings(api_keys=KEY, **QUIET), loader=lambda _: tiny_served)
    with serving(app) as base:
        wait_ready(base)
        engine = app.state.runtime.engine
        original = engine.runner.forward
        engine.runner.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
        body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION}
        broken = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY})
        assert "device lost" in error_of(broken, 500, "api_error")
        events = raw_events(base, body)
        assert [name for name, _ in events] == ["message_start", "error"]
        assert events[-1][1]["error"]["type"] == "api_error"
        assert "device lost" in events[-1][1]["error"]["message"]
        engine.runner.forward = original
        assert httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY}).is_success
