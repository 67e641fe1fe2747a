"""`logprobs` / `top_logprobs` on both routes, through real HTTP clients, on the tiny model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from app.background import serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import QUIET, sse_events, wait_ready

PROMPT = "one two three one two three one two three"
MESSAGES = [{"role": "user", "content": PROMPT}]
SPECULATIONS = {
    "off": {"mode": "off"},
    "fixed": {"mode": "fixed", "k": 4, "w": 4, "strategy": "context"},
}


@pytest.fixture(scope="module")
def server(tiny_served):
    settings = Settings(spec_mode="fixed", spec_k=4, spec_w=4, max_tokens=12, **QUIET)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        yield base


def post(base: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/{route}", json=body, timeout=60)


def chat(base: str, top: int, speculation: str = "fixed", **extra) -> dict:
    body = {
        "messages": MESSAGES,
        "logprobs": True,
        "top_logprobs": top,
        "speculation": SPECULATIONS[speculation],
    }
    response = post(base, "chat/completions", {**body, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def completion(base: str, logprobs: int, speculation: str = "fixed", **extra) -> dict:
    body = {
        "prompt": PROMPT,
        "logprobs": logprobs,
        "max_tokens": 12,
        "speculation": SPECULATIONS[speculation],
    }
    response = post(base, "completions", {**body, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_logprobs_are_the_same_with_and_without_speculation(server: str) -> None:
    plain, speculative = (
        chat(server, 3, s)["choices"][0]["logprobs"]["content"] for s in SPECULATIONS
    )
    assert [e["token"] for e in speculative] == [e["token"] for e in plain] and len(plain) == 12
    assert [e["logprob"] for e in speculative] == pytest.approx(
        [e["logprob"] for e in plain], abs=1e-4
    )


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_chat_top_logprobs_are_sorted_of_the_asked_length_and_greedy_first(
    server: str, top: int
) -> None:
    body = chat(server, top)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert len(values) == top and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
        if top:  # temperature 0: the chosen token is the likeliest
            assert (entry["top_logprobs"][0]["token"], entry["top_logprobs"][0]["logprob"]) == (
                entry["token"],
                pytest.approx(entry["logprob"]),
            )
    text = body["choices"][0]["message"]["content"]
    assert "".join(e["token"] for e in content).startswith(text)


def test_completions_logprobs_shape_and_offsets(server: str) -> None:
    choice = completion(server, 3)["choices"][0]
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 12
    assert logprobs["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for token, logprob, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(logprob)  # greedy
        assert top[token] == pytest.approx(logprob)


def test_no_logprobs_unless_asked(server: str) -> None:
    reply = post(
        server, "chat/completions", {"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}
    ).json()
    assert reply["choices"][0]["logprobs"] is None
    for ask_nothing in (
        {},
        {"logprobs": None},
        {"logprobs": False},
    ):  # `false`: what some clients send
        reply = post(server, "completions", {"prompt": PROMPT, **ask_nothing}).json()
        assert reply["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_streamed_logprobs_concatenate_to_the_non_streamed_ones(server: str, route: str) -> None:
    ask = chat if route == "chat/completions" else completion
    whole = ask(server, 2)["choices"][0]["logprobs"]
    body = (
        {"prompt": PROMPT, "logprobs": 2, "max_tokens": 12}
        if route == "completions"
        else {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    )
    body |= {"stream": True, "speculation": SPECULATIONS["fixed"]}
    with httpx.stream("POST", f"{server}/v1/{route}", json=body, timeout=60) as response:
        chunks = [json.loads(e) for e in sse_events(response) if e != "[DONE]"]
    parts = [
        c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
    ]
    assert len(parts) > 1  # one per round: several rounds here
    for chunk in chunks:  # each chunk carries the logprobs of the text it carries
        choice = chunk["choices"][0] if chunk["choices"] else None
        text = choice and (choice.get("text") or (choice.get("delta") or {}).get("content"))
        if text:
            assert choice["logprobs"] is not None
    if route == "chat/completions":
        assert [e for p in parts for e in p["content"]] == whole["content"]
    else:
        assert {key: [x for p in parts for x in p[key]] for key in whole} == whole


def test_the_openai_package_parses_both_routes_streamed_and_not(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny-random-llama", messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=6
    )
    content = reply.choices[0].logprobs.content
    assert (
        len(content) == 6
        and len(content[0].top_logprobs) == 2
        and isinstance(content[0].logprob, float)
    )
    streamed = client.chat.completions.create(
        model="tiny-random-llama",
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=2,
        max_tokens=6,
        stream=True,
    )
    tokens = [
        e.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in content]
    legacy = client.completions.create(
        model="tiny-random-llama", prompt=PROMPT, logprobs=2, max_tokens=6
    )
    assert (
        len(legacy.choices[0].logprobs.tokens) == 6
        and legacy.choices[0].logprobs.text_offset[0] == 0
    )
    pieces = client.completions.create(
        model="tiny-random-llama", prompt=PROMPT, logprobs=2, max_tokens=6, stream=True
    )
    streamed_tokens = [
        t for p in pieces if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens
    ]
    assert streamed_tokens == legacy.choices[0].logprobs.tokens


@pytest.mark.parametrize(
    "route,extra,param",
    [
        ("completions", {"logprobs": 6}, "logprobs"),  # above MAX_COMPLETION_LOGPROBS
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),  # a count here, not a switch
        ("completions", {"top_logprobs": 2}, "top_logprobs"),  # a chat field
        (
            "chat/completions",
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),  # above MAX_TOP_LOGPROBS
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": 2}, "logprobs"),  # a switch here, not a count
    ],
)
def test_bad_logprobs_values_are_400_naming_the_field(
    server: str, route: str, extra: dict, param: str
) -> None:
    base = {"messages": MESSAGES} if route == "chat/completions" else {"prompt": PROMPT}
    response = post(server, route, {**base, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert param in error["message"]
