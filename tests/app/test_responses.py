"""OpenAI's Responses API through the real `openai` client (and httpx for the raw events),
against the chat route as the reference: the same conversation gets the same greedy answer,
stored responses continue, and a background response can be polled and cancelled."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from app.background import serving
from app.main import create_app
from app.responses_api.schemas import ResponsesRequest
from app.responses_api.store import ResponseStore, StoredResponse
from app.responses_api.translate import ResponseState
from app.settings import Settings
from service.model.prefix_cache import BLOCK_TOKENS
from tests.helpers.http import QUIET, slowed, wait_ready, wait_until
from tests.helpers.tools import CHAT_WEATHER, RESPONSES_WEATHER

KEY = "responses-key"
MODEL = "tiny-random-llama"
CAP = 256
QUESTION = "List the first five prime numbers."


@pytest.fixture(scope="module")
def app(tiny_served):
    settings = Settings(api_keys=KEY, max_tokens=16, max_tokens_cap=CAP, **QUIET)
    return create_app(settings, loader=lambda _: tiny_served)


@pytest.fixture(scope="module")
def server(app):
    with serving(app) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict], **fields) -> dict:
    """The chat route's answer, the reference."""
    return client.chat.completions.create(messages=messages, model=MODEL, **fields).model_dump()


def test_a_response_is_the_chat_routes_answer_and_is_stored(client) -> None:
    reference = chat(client, [{"role": "user", "content": QUESTION}], max_tokens=16)
    response = client.responses.create(input=QUESTION, model=MODEL)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == reference["choices"][0]["message"]["content"]
    assert (
        response.status
        == {"length": "incomplete", "stop": "completed"}[reference["choices"][0]["finish_reason"]]
    )
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == reference["usage"]["completion_tokens"]
    assert client.responses.retrieve(response.id).output_text == response.output_text
    assert client.responses.delete(response.id) is None  # the client reads no body
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(input=QUESTION, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_instructions_and_items_map_to_chat_messages(client) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi! How can I help?"}]},
        {"type": "message", "role": "user", "content": "Name a color."},
    ]
    reference = chat(
        client,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=12,
    )
    response = client.responses.create(input=items, instructions="Be brief.", max_output_tokens=12)
    assert response.output_text == reference["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == reference["usage"]["prompt_tokens"]


def test_a_later_turn_continues_the_stored_conversation_without_its_instructions(client) -> None:
    first = client.responses.create(input=QUESTION, instructions="Be brief.", max_output_tokens=8)
    second = client.responses.create(
        input="And the next one?", previous_response_id=first.id, max_output_tokens=8
    )
    reference = chat(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And the next one?"},
        ],
        max_tokens=8,
    )
    assert second.previous_response_id == first.id
    # the earlier prompt's whole blocks came from the prefix cache: only the rest was prefilled
    whole_blocks = first.usage.input_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert second.usage.input_tokens_details.cached_tokens >= whole_blocks > 0
    assert second.output_text == reference["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == reference["usage"]["prompt_tokens"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="x", previous_response_id="resp_unknown")


def raw_events(server: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST",
        f"{server}/v1/responses",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    events = []
    for block in text.strip("\n").split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_a_stream_sends_the_typed_events_and_the_same_text(server, client) -> None:
    whole = client.responses.create(input=QUESTION)
    events = raw_events(server, {"input": QUESTION})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == f"response.{whole.status}"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == whole.output_text == final["output"][0]["content"][0]["text"]
    assert final["usage"] == whole.usage.model_dump(exclude_none=True)
    assert client.responses.retrieve(final["id"]).output_text == text  # stored at its end
    with client.responses.stream(input=QUESTION, model=MODEL) as stream:
        typed = list(stream)  # the client's own event types
    streamed = "".join(e.delta for e in typed if e.type == "response.output_text.delta")
    assert streamed == whole.output_text and typed[-1].response.output_text == streamed


def test_function_calls_are_the_chat_routes_and_their_outputs_go_back(server, client) -> None:
    ask = "What is the weather in Paris?"
    reference = chat(
        client,
        [{"role": "user", "content": ask}],
        tools=[CHAT_WEATHER],
        tool_choice="required",
        max_tokens=CAP,
    )["choices"][0]
    response = client.responses.create(
        input=ask, tools=[RESPONSES_WEATHER], tool_choice="required", max_output_tokens=CAP
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert reference["finish_reason"] == "tool_calls" and response.status == "completed"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in reference["message"]["tool_calls"]
    ]
    events = raw_events(
        server,
        {
            "input": ask,
            "tools": [RESPONSES_WEATHER],
            "tool_choice": "required",
            "max_output_tokens": CAP,
        },
    )
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == [c.arguments for c in calls]
    answered = client.responses.create(
        input=[
            {"role": "user", "content": ask},
            *[
                {
                    "type": "function_call",
                    "call_id": c.call_id,
                    "name": c.name,
                    "arguments": c.arguments,
                }
                for c in calls
            ],
            *[
                {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"}
                for c in calls
            ],
        ],
        tools=[RESPONSES_WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert answered.output[0].type == "message"
    # the same turn, continued from the stored response instead of sent again
    continued = client.responses.create(
        previous_response_id=response.id,
        input=[
            {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"} for c in calls
        ],
        tools=[RESPONSES_WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert continued.output_text == answered.output_text
    assert continued.usage.input_tokens == answered.usage.input_tokens
    # what the continued response was given: the first turn's input and output, then its own
    given = list(client.responses.input_items.list(continued.id, order="asc", limit=1))
    assert [item.type for item in given] == ["message", *["function_call"] * len(calls)] + [
        "function_call_output"
    ] * len(calls)
    assert given[0].content[0].text == ask and given[0].role == "user"
    assert [item.id for item in given[1 : 1 + len(calls)]] == [c.id for c in calls]
    assert len({item.id for item in given}) == len(given)
    newest = client.responses.input_items.list(continued.id)  # `desc` by default
    assert [item.id for item in newest.data] == [item.id for item in given][::-1]
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(continued.id, after="msg_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_a_json_schema_format_holds_the_text_to_it(client) -> None:
    schema = {
        "type": "object",
        "properties": {"prime": {"type": "integer"}},
        "required": ["prime"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        input="Name a prime.",
        text={"format": {"type": "json_schema", "name": "prime", "schema": schema}},
        max_output_tokens=CAP,
    )
    reference = chat(
        client,
        [{"role": "user", "content": "Name a prime."}],
        response_format={"type": "json_schema", "json_schema": {"name": "prime", "schema": schema}},
        max_tokens=CAP,
    )
    assert response.output_text == reference["choices"][0]["message"]["content"]
    assert isinstance(json.loads(response.output_text)["prime"], int)


def test_a_background_response_is_polled_and_can_be_cancelled(app, client) -> None:
    background = client.responses.create(input=QUESTION, background=True)
    assert background.status == "in_progress"
    wait_until(lambda: client.responses.retrieve(background.id).status != "in_progress")
    assert client.responses.retrieve(background.id).output_text == (
        client.responses.create(input=QUESTION).output_text
    )
    with slowed(app, 0.05):
        running = client.responses.create(input=QUESTION, background=True, max_output_tokens=CAP)
        time.sleep(0.3)
        cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    wait_until(lambda: app.state.runtime.async_engine.num_running == 0, timeout=10)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(input=QUESTION).id)


def test_bad_requests_get_openai_errors_naming_the_responses_fields(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    cases = [
        ({"input": QUESTION, "max_output_tokens": CAP + 1}, "max_output_tokens"),
        ({"input": ""}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": QUESTION, "background": True, "stream": True}, None),
        ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {
                "input": QUESTION,
                "tools": [{**RESPONSES_WEATHER, "parameters": {"allOf": [{}, {}]}}],
            },
            "tools.0.parameters.allOf",
        ),
        (
            {
                "input": QUESTION,
                "tool_choice": {"type": "function", "name": "x"},
                "tools": [RESPONSES_WEATHER],
            },
            "tool_choice",
        ),
    ]
    for body, param in cases:
        reply = httpx.post(f"{server}/v1/responses", json=body, headers=headers)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert httpx.post(f"{server}/v1/responses", json={"input": "x"}).status_code == 401
    # GET and DELETE of a response are two routes: a 405 names both
    wrong = httpx.put(f"{server}/v1/responses/resp_x", headers=headers)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, GET"


def state(size: int) -> ResponseState:
    return ResponseState(ResponsesRequest.model_validate({"input": "x" * size}), "m")


def test_the_store_keeps_the_most_recently_used_within_its_bounds() -> None:
    store = ResponseStore(max_count=2, max_bytes=1 << 20)
    first, second, third = (StoredResponse(state(1), [], []) for _ in range(3))
    store.put(first)
    store.put(second)
    assert store.get(first.state.id) is first  # now the most recently used
    store.put(third)
    assert first.state.id in store and second.state.id not in store and third.state.id in store
    small = ResponseStore(max_count=10, max_bytes=3 * first.size())
    for stored in (first, second, third, StoredResponse(state(1), [], [])):
        small.put(stored)
    assert first.state.id not in small and third.state.id in small
    huge = StoredResponse(state(1), [{"role": "user", "content": "x" * (4 << 20)}], [])
    store.put(huge)
    assert huge.state.id not in store  # larger than all the memory: not kept
    assert ResponseStore(0, 1 << 20).get(first.state.id) is None


@pytest.mark.parametrize(
    "speculation",
    [{"mode": "off"}, {"mode": "fixed", "k": 2, "w": 4}, {"mode": "auto", "k": 4, "w": 4}],
)
def test_every_route_answers_a_conversation_alike(server, client, speculation) -> None:
    """Chat, Responses and Messages put the same conversation to the same engine: greedy, the
    same text whatever the speculation."""
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": QUESTION},
    ]
    extra = {"speculation": speculation}
    via_chat = chat(client, turns, max_tokens=24, extra_body=extra)["choices"][0]["message"]
    via_responses = client.responses.create(input=turns, max_output_tokens=24, extra_body=extra)
    messages = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0).messages
    via_messages = messages.create(model=MODEL, max_tokens=24, messages=turns, extra_body=extra)
    assert via_chat["content"] == via_responses.output_text == via_messages.content[0].text
    drafted = via_responses.model_extra["speculative_decoding_stats"]["num_draft_tokens"]
    if speculation["mode"] == "off":
        assert drafted == 0
    elif speculation["mode"] == "fixed":
        assert drafted > 0  # (auto decides for itself)
