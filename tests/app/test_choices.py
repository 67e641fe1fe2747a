"""`n` choices per request, through real HTTP on the tiny model: each sampled choice is the
sample of its own seed, greedy ones are one text n times, and the request's end (a client
gone, a full queue, an engine failure) ends all of its engine requests and counts it once."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from app.main import create_app
from app.schemas import MAX_N
from app.settings import Settings
from tests.helpers.http import (
    QUIET,
    assert_engine_idle,
    assert_openai_error,
    post,
    serving_ready,
    slowed,
    sse_events,
    wait_until,
)

MODEL = "tiny-random-llama"
ROUTES = {
    "chat/completions": {"messages": [{"role": "user", "content": "Say hi."}]},
    "completions": {"prompt": "Say hi."},
}
SEED = 2**63 - 2  # choices 0, 1, 2 sample with seeds 2^63 - 2, 2^63 - 1 and 0
SAMPLED = {"max_tokens": 12, "temperature": 1.0}
LONG = {"prompt": "Count to a thousand.", "max_tokens": 400, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_served):
    settings = Settings(spec_mode="fixed", spec_k=4, spec_w=3, **QUIET)
    with serving_ready(create_app(settings, loader=lambda _: tiny_served)) as base:
        yield base


@dataclass
class Answer:
    """A response's choices in index order, as the openai client parsed them."""

    texts: list[str]
    finish_reasons: list[str]
    usage: openai.types.CompletionUsage
    roles: list[int] = field(default_factory=list)  # streamed chat: the indices whose role came


def answer(base: str, route: str, stream: bool, **fields) -> Answer:
    """Ask through the openai client; a stream is assembled by choice index."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    chat = route == "chat/completions"
    create = client.chat.completions.create if chat else client.completions.create
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    reply = create(model=MODEL, **ROUTES[route], **fields, stream=stream, **extra)
    if not stream:
        assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
        texts = [c.message.content if chat else c.text for c in reply.choices]
        return Answer(texts, [c.finish_reason for c in reply.choices], reply.usage)
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    roles, usage = [], None
    for chunk in reply:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            assert choice.index not in finishes  # nothing after a choice's final chunk
            if chat and choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert (
        sorted(finishes) == list(range(len(finishes))) and chunk.choices == []
    )  # the usage chunk last
    return Answer(
        [texts[i] for i in sorted(finishes)], [finishes[i] for i in sorted(finishes)], usage, roles
    )


def metric(base: str, sample: str) -> float:
    """One sample's value in /metrics (`name` or `name{labels}`), 0 if absent."""
    found = re.search(rf"^{re.escape(sample)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


# --- the choices ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_seeded_choices_are_the_samples_of_consecutive_seeds(server: str, route: str) -> None:
    singles = [
        answer(server, route, False, n=1, seed=(SEED + i) % 2**63, **SAMPLED) for i in range(3)
    ]
    assert len({s.texts[0] for s in singles}) == 3  # three different samples
    for stream in (False, True):
        got = answer(server, route, stream, n=3, seed=SEED, **SAMPLED)
        assert got.texts == [s.texts[0] for s in singles]
        assert got.finish_reasons == [s.finish_reasons[0] for s in singles]
        completion = sum(s.usage.completion_tokens for s in singles)
        prompt = singles[0].usage.prompt_tokens  # once: the choices share it
        assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
            prompt,
            completion,
            prompt + completion,
        )
        if stream and route == "chat/completions":
            assert got.roles == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ROUTES)
def test_greedy_choices_are_one_text_n_times_from_one_engine_request(
    server: str, route: str, stream: bool
) -> None:
    single = answer(server, route, False, n=1, max_tokens=12, temperature=0)
    generated = metric(server, "ngrammys_generation_tokens_total")
    got = answer(server, route, stream, n=2, max_tokens=12, temperature=0)
    assert got.texts == single.texts * 2 and got.finish_reasons == single.finish_reasons * 2
    assert got.usage.completion_tokens == 2 * single.usage.completion_tokens
    assert (
        metric(server, "ngrammys_generation_tokens_total") - generated
        == single.usage.completion_tokens
    )


@pytest.mark.parametrize("temperature", [0, 1])
def test_every_choice_has_its_own_logprobs_streamed_as_whole(
    server: str, temperature: float
) -> None:
    body = {
        **ROUTES["completions"],
        "n": 2,
        "seed": 5,
        "temperature": temperature,
        "max_tokens": 8,
        "logprobs": 1,
    }
    whole = post(server, "completions", body).json()["choices"]
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    streamed: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for choice in (c["choices"][0] for c in chunks):
        for key, values in (choice["logprobs"] or {}).items():
            streamed[choice["index"]][key] += values
    for choice in whole:
        logprobs = choice["logprobs"]
        got = streamed[choice["index"]]
        assert (got["tokens"], got["text_offset"]) == (logprobs["tokens"], logprobs["text_offset"])
        assert got["token_logprobs"] == pytest.approx(
            logprobs["token_logprobs"], abs=1e-4
        )  # passes of other shapes
        assert len(logprobs["tokens"]) == 8
        assert logprobs["text_offset"][0] == 0  # each choice's offsets count in its own text
    assert (whole[0]["logprobs"]["tokens"] == whole[1]["logprobs"]["tokens"]) == (temperature == 0)


def test_continuous_usage_is_each_choices_own(server: str) -> None:
    body = {
        **ROUTES["completions"],
        "n": 3,
        "seed": 9,
        **SAMPLED,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    counts: dict[int, list[int]] = defaultdict(list)
    for chunk in chunks:
        if chunk["choices"][0]["finish_reason"] is None:
            counts[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
    for index, seen in counts.items():
        assert seen == sorted(seen) and 0 < seen[-1] <= SAMPLED["max_tokens"], (index, seen)
    assert sorted(counts) == [0, 1, 2]


def test_a_request_of_n_choices_counts_once(server: str) -> None:
    prompt_tokens = answer(server, "completions", False, n=1, max_tokens=2).usage.prompt_tokens
    before = {
        name: metric(server, name)
        for name in (
            'ngrammys_requests_total{status="ok"}',
            "ngrammys_prompt_tokens_total",
            "ngrammys_e2e_request_latency_seconds_count",
        )
    }
    answer(server, "completions", False, n=3, seed=1, **SAMPLED)
    assert {name: metric(server, name) - value for name, value in before.items()} == {
        'ngrammys_requests_total{status="ok"}': 1,
        "ngrammys_prompt_tokens_total": prompt_tokens,
        "ngrammys_e2e_request_latency_seconds_count": 1,
    }


# --- what is refused ---------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("n", [0, MAX_N + 1, "x", 2.5, True])
def test_n_outside_its_range_is_400_naming_n(server: str, route: str, n) -> None:
    assert_openai_error(post(server, route, {**ROUTES[route], "n": n}), 400, "n")


def test_the_largest_n_is_accepted(server: str) -> None:
    got = answer(server, "completions", False, n=MAX_N, max_tokens=2, temperature=1)
    assert len(got.texts) == MAX_N


# --- the request's end ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_mid_stream_leaves_no_choice_running(tiny_served, stream: bool) -> None:
    app = create_app(Settings(**QUIET), loader=lambda _: tiny_served)
    with serving_ready(app) as base, slowed(app, 0.05):
        body = {**LONG, "n": 3, "temperature": 1, "seed": 3, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                lines, indices = response.iter_lines(), set()
                while len(indices) < 3:  # every choice is under way
                    line = next(lines)
                    if line.startswith("data: "):
                        indices.add(json.loads(line[len("data: ") :])["choices"][0]["index"])
                assert httpx.get(f"{base}/health").json()["requests_running"] == 3
                assert app.state.concurrency.in_flight["anonymous"] == 1  # one slot, whatever n
        else:
            with pytest.raises(httpx.ReadTimeout):  # sent, then the connection is dropped unread
                httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=5)
        assert httpx.get(f"{base}/health").json()["requests_waiting"] == 0
        assert metric(base, "ngrammys_client_disconnects_total") == 1
        assert metric(base, 'ngrammys_requests_total{status="aborted"}') == 1
        assert not app.state.concurrency.in_flight
        assert_engine_idle(app)


def test_a_queue_that_fills_midway_refuses_the_request_and_keeps_none_of_it(tiny_served) -> None:
    settings = Settings(max_running_requests=1, max_waiting=3, retry_after_seconds=3, **QUIET)
    app = create_app(settings, loader=lambda _: tiny_served)
    with serving_ready(app) as base, slowed(app, 0.05):
        health = lambda: httpx.get(f"{base}/health").json()  # noqa: E731
        with httpx.stream("POST", f"{base}/v1/completions", json=LONG, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream, aborting it
            next(lines)
            sampled = {**LONG, "n": 2, "temperature": 1, "seed": 3}
            with httpx.stream("POST", f"{base}/v1/completions", json=sampled, timeout=60):
                wait_until(lambda: health()["requests_waiting"] == 2)
                # its first choice is queued, its second finds the queue full
                refused = post(base, "completions", {**sampled, "stream": False})
                assert_openai_error(refused, 429)
                assert refused.headers["retry-after"] == "3"
                wait_until(lambda: health()["requests_waiting"] == 2)  # the first is gone again
                assert app.state.concurrency.in_flight["anonymous"] == 2  # its slot released once
                # never fits
                assert_openai_error(post(base, "completions", {**sampled, "n": 4}), 400, "n")
        wait_until(
            lambda: health()["requests_running"] == health()["requests_waiting"] == 0, timeout=30
        )
        assert not app.state.concurrency.in_flight
        assert_engine_idle(app)
        assert (
            httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]["CompletionRequest"][
                "properties"
            ]["n"]["maximum"]
            == 3
        )


def test_an_engine_failure_ends_every_choice_with_one_error(tiny_served) -> None:
    app = create_app(Settings(**QUIET), loader=lambda _: tiny_served)
    with serving_ready(app) as base:
        app.state.runtime.engine.runner.forward = lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("device lost")
        )
        body = {**ROUTES["chat/completions"], "n": 3, "temperature": 1, "max_tokens": 4}
        broken = post(base, "chat/completions", body)
        assert broken.status_code == 500 and "device lost" in broken.json()["error"]["message"]
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            events = sse_events(response)
        assert events[-1] == "[DONE]" and sum('"error"' in e for e in events) == 1
        assert "device lost" in json.loads(events[-2])["error"]["message"]
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=5)
        assert metric(base, 'ngrammys_requests_total{status="error"}') == 2
        assert not app.state.concurrency.in_flight
        assert_engine_idle(app)
