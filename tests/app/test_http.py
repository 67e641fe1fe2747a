"""The minimal HTTP API through real clients (httpx and the openai package)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from app.main import create_app
from app.settings import Settings
from drafting import TableSlot
from service.config import GenerationParams
from service.prompts import chat_prompt_ids
from service.runtime import build_engine
from tests.app.server import serving

MESSAGES = [{"role": "user", "content": "List the first five prime numbers."}]


def wait_ready(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base}/ready").status_code != 200:
        assert time.monotonic() < deadline, "server never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(embedded):
    settings = Settings(spec_mode="fixed", spec_k=4, spec_w=4, max_tokens=24, model_tables=False,
                        cost_profile=False)
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        yield base


def test_chat_completion_equals_engine_output(server: str, embedded) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    reply = client.chat.completions.create(model=embedded.name, messages=MESSAGES, max_tokens=24)

    engine = build_engine(embedded, TableSlot())
    prompt_ids = chat_prompt_ids(embedded.tokenizer, MESSAGES)
    direct = engine.complete(prompt_ids, GenerationParams(max_new_tokens=24))  # plain decoding
    assert reply.choices[0].message.content == embedded.tokenizer.decode(
        direct.token_ids, skip_special_tokens=True
    )
    assert reply.choices[0].finish_reason == direct.finish_reason
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(direct.token_ids)
    assert reply.model == embedded.name


def test_model_field_is_optional_and_defaults_apply(server: str) -> None:
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": MESSAGES}, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] <= 24


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"messages": MESSAGES, "model": "gpt-9"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": MESSAGES, "stream": True}, 400, "stream"),
        ({"messages": MESSAGES, "temperature": 0.7}, 400, "temperature"),
        ({"messages": MESSAGES, "max_tokens": 9000}, 400, "messages"),
        ({"messages": MESSAGES, "speculation": {"strategy": "trigram"}}, 400, "speculation.strategy"),
        ({"messages": MESSAGES, "speculation": {"k": 2, "w": 0}}, 400, "speculation"),
        ({"messages": MESSAGES, "speculation": {"k": -1}}, 400, "speculation.k"),
        ({"messages": MESSAGES, "speculation": {"mode": "turbo"}}, 400, "speculation.mode"),
    ],
)
def test_bad_requests_get_openai_errors(server: str, body, status: int, param: str) -> None:
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"]
    assert httpx.get(f"{server}/health").status_code == 200  # and the server lives on


def test_ready_waits_for_the_model_and_health_does_not(embedded) -> None:
    release = threading.Event()

    def slow_loader(_: Settings):
        release.wait(timeout=30)
        return embedded

    with serving(create_app(Settings(model_tables=False, cost_profile=False), loader=slow_loader)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").json()["status"] == "loading"
        busy = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES})
        assert busy.status_code == 503 and "loading" in busy.json()["error"]["message"]
        release.set()
        wait_ready(base)


def test_failed_load_is_reported_not_fatal() -> None:
    def broken_loader(_: Settings):
        raise FileNotFoundError("no model at /nowhere")

    with serving(create_app(Settings(model_tables=False, cost_profile=False), loader=broken_loader)) as base:
        deadline = time.monotonic() + 10
        while (ready := httpx.get(f"{base}/ready").json())["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ready["status"] == "failed" and "/nowhere" in ready["error"]
        assert httpx.get(f"{base}/health").status_code == 200


def test_greedy_text_is_the_same_with_and_without_speculation(embedded) -> None:
    """Lossless end to end: plain and speculating servers answer with the same text."""
    texts = []
    for k, w in [(0, 0), (6, 3)]:
        settings = Settings(spec_mode="fixed", spec_k=k, spec_w=w, model_tables=False, cost_profile=False)
        with serving(create_app(settings, loader=lambda _: embedded)) as base:
            wait_ready(base)
            body = {"messages": MESSAGES, "max_tokens": 20}
            texts.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json())
    assert texts[0]["choices"] == texts[1]["choices"]


@pytest.mark.parametrize("strategy", ["context", "extended_bigram", "mixed"])
def test_speculation_options_per_request(server: str, strategy: str) -> None:
    plain = {"messages": MESSAGES, "max_tokens": 16, "speculation": {"mode": "off"}}
    chosen = {**plain, "speculation": {"mode": "fixed", "k": 3, "w": 2, "strategy": strategy}}
    answers = [httpx.post(f"{server}/v1/chat/completions", json=b, timeout=60) for b in (plain, chosen)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["choices"] == answers[1].json()["choices"]
