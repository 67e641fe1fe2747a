"""The OpenAI-compatible API through real HTTP clients (httpx and the openai package)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from app.background import serving
from app.main import create_app
from app.settings import Settings
from drafting import TableSlot
from service.engine.params import GenerationParams, SamplingParams
from service.kernels import packed_linear
from service.model.prompts import chat_prompt_ids
from service.runtime import build_engine
from tests.helpers.http import (
    COPY_LONG,
    MESSAGES,
    QUIET,
    accepted_draft_tokens,
    assert_engine_idle,
    slowed,
    speculating,
    sse_events,
    wait_ready,
    wait_until,
)

EMOJI = [{"role": "user", "content": "Repeat exactly: 🙂🙂🙂 café naïve 日本"}]
PARAGRAPH = (
    "The committee met on Tuesday to review the budget. It approved the new library, "
    "postponed the bridge repairs until spring, and asked the treasurer for a report on "
    "the water rates before the next meeting."
)
COPY = [{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"}]


@pytest.fixture(scope="module")
def server(embedded):
    # max_tokens_cap above the context, so a request too long for the model meets that check
    settings = Settings(
        spec_mode="fixed", spec_k=8, spec_w=6, max_tokens=24, max_tokens_cap=10_000, **QUIET
    )
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def direct(embedded):
    """Plain greedy decoding straight from the engine: what the API must reproduce."""
    return plain_decoding(embedded)


def plain_decoding(loaded):
    """`loaded`'s plain greedy decoding by an engine of its own: (text, completion, prompt ids)."""
    engine = build_engine(loaded, TableSlot())

    def decode(messages=None, prompt=None, max_tokens=24, sampling=SamplingParams()):
        tokenizer = loaded.tokenizer
        ids = chat_prompt_ids(tokenizer, messages) if messages else tokenizer.encode(prompt)
        completion = engine.complete(
            ids, GenerationParams(max_new_tokens=max_tokens, sampling=sampling)
        )
        return tokenizer.decode(completion.token_ids, skip_special_tokens=True), completion, ids

    return decode


# --- both routes, both ways, through the openai client ---------------------------------


def test_chat_non_streaming_equals_engine_output(server: str, embedded, direct) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=embedded.name,
        messages=MESSAGES,
        max_tokens=24,
        extra_body={"speculation": {"k": 4, "w": 4}},
    )
    text, completion, ids = direct(MESSAGES)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == completion.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(ids),
        len(completion.token_ids),
    )
    stats = reply.choices[0].model_extra["speculative_decoding_stats"]
    assert stats["num_spec_steps"] >= 1 and stats["k"] == 4 and stats["w"] == 4
    assert sum(stats["acceptance_histogram"]) == stats["num_spec_steps"]
    assert stats["mean_acceptance_length"] == pytest.approx(
        len(completion.token_ids) / stats["num_spec_steps"]
    )


def test_chat_streaming_equals_engine_output(server: str, direct) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES,
            model="SmolLM2-135M-Instruct",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text, completion, ids = direct(MESSAGES)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == completion.finish_reason
    assert "speculative_decoding_stats" in finals[0].choices[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        completion.token_ids
    )


@pytest.mark.parametrize("stream", [False, True])
def test_completions_route_equals_engine_output(server: str, direct, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    prompt = "The three primary colors are"
    text, completion, _ = direct(prompt=prompt, max_tokens=20)
    if stream:
        pieces = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=20, stream=True
        )
        assert "".join(p.choices[0].text for p in pieces) == text
    else:
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=20
        )
        assert reply.choices[0].text == text and reply.object == "text_completion"
        assert reply.usage.completion_tokens == len(completion.token_ids)


def test_models_lists_the_served_model(server: str, embedded) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [embedded.name]


# --- streaming details ---------------------------------------------------------------


def test_sse_framing_one_event_per_round_and_done_last(server: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 24, "stream": True, "speculation": {"mode": "off"}}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # plain decoding: one round per token, so (bar held-back characters) one event per token
    assert (
        len(content)
        >= 0.8 * chunks[-1]["choices"][0]["speculative_decoding_stats"]["num_spec_steps"]
    )


def test_multibyte_characters_are_never_split(server: str, direct) -> None:
    body = {"messages": EMOJI, "max_tokens": 24, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    text, _, _ = direct(EMOJI)
    assert "🙂" in text and "".join(pieces) == text
    assert all(
        "\ufffd" not in p for p in pieces[:-2]
    )  # only a cut at max_tokens may end unfinished


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_across_rounds(server: str, direct, stream: bool) -> None:
    text, _, _ = direct(MESSAGES, max_tokens=40)
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # a 4-character stop inside the output
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "stop": [stop, "never appears"],
        "stream": stream,
        "speculation": {"mode": "fixed", "k": 6, "w": 5},
    }
    if stream:
        with httpx.stream(
            "POST", f"{server}/v1/chat/completions", json=body, timeout=60
        ) as response:
            chunks = [json.loads(e) for e in sse_events(response)[:-1]]
        got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()[
            "choices"
        ][0]
        got, finish = choice["message"]["content"], choice["finish_reason"]
    assert got == text[: text.index(stop)] and finish == "stop"


def test_disconnect_mid_stream_frees_the_engine(embedded) -> None:
    app = create_app(Settings(**QUIET), loader=lambda _: embedded)
    with serving(app) as base, slowed(app, 0.2):
        wait_ready(base)
        speculating(app)
        body = {"messages": COPY_LONG, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"content"' in line and '""' not in line)
            # it left in the middle of speculating
            wait_until(lambda: accepted_draft_tokens(base) > 0, timeout=30)
            assert httpx.get(f"{base}/health").json()["requests_running"] == 1
        # the client is gone: the worker notices within a round, long before 400 tokens
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=3)
        assert "ngrammys_client_disconnects_total 1.0" in httpx.get(f"{base}/metrics").text
        assert_engine_idle(app)


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route,body,status,param",
    [
        ("chat/completions", {"messages": MESSAGES, "model": "gpt-9"}, 404, "model"),
        ("chat/completions", {"messages": []}, 400, "messages"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        (
            "chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            400,
            "messages.0.role",
        ),
        ("chat/completions", {"messages": MESSAGES, "n": 0}, 400, "n"),
        (
            "chat/completions",
            {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]},
            400,
            "stop",
        ),
        ("chat/completions", {"messages": MESSAGES, "temperature": 3}, 400, "temperature"),
        ("chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 9000}, 400, "messages"),
        (
            "chat/completions",
            {"messages": MESSAGES, "speculation": {"strategy": "trigram"}},
            400,
            "speculation.strategy",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "speculation": {"mode": "fixed", "k": 2, "w": 0}},
            400,
            "speculation",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "speculation": {"mode": "turbo"}},
            400,
            "speculation.mode",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "speculation": {"k": -1}},
            400,
            "speculation.k",
        ),
        ("completions", {"prompt": ""}, 400, "prompt"),
        ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("completions", {"prompt": [5, 10**9]}, 400, "prompt"),
        ("completions", {"prompt": "hi", "echo": True}, 400, "echo"),
        ("completions", {"prompt": "hi", "max_tokens": 9000}, 400, "prompt"),
        ("completions", {}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: str, route: str, body, status: int, param: str
) -> None:
    response = httpx.post(f"{server}/v1/{route}", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert httpx.get(f"{server}/health").status_code == 200  # and the server lives on


def test_context_error_gives_both_numbers(server: str) -> None:
    response = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 9000})
    assert (
        "8192" in response.json()["error"]["message"]
        and "9000" in response.json()["error"]["message"]
    )


def test_unknown_fields_are_ignored(server: str) -> None:
    # (fields OpenAI defines but this server does not implement are refused: test_hardening.py)
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "store": False,
        "metadata": {"a": "b"},
        "frequency_penalty": 0,
    }
    assert httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_queue_full_gets_429_with_retry_after(embedded) -> None:
    settings = Settings(max_waiting=1, max_running_requests=1, retry_after_seconds=3, **QUIET)
    app = create_app(settings, loader=lambda _: embedded)
    with serving(app) as base, slowed(app, 0.2):
        wait_ready(base)
        speculating(app)
        long = {"messages": COPY_LONG, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=long, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream, aborting it
            next(lines)
            # refused while one speculates
            wait_until(lambda: accepted_draft_tokens(base) > 0, timeout=30)
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json=long, timeout=60
            ) as waiting:
                wait_until(lambda: httpx.get(f"{base}/health").json()["requests_waiting"] == 1)
                refused = httpx.post(f"{base}/v1/chat/completions", json=long, timeout=60)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
                assert refused.json()["error"]["type"] == "rate_limit_exceeded"
                del waiting
        idle = {"status": "ok", "requests_running": 0, "requests_waiting": 0}
        wait_until(lambda: httpx.get(f"{base}/health").json().items() >= idle.items(), timeout=30)
        assert_engine_idle(app)


def test_timeout_and_engine_failures_fail_only_their_request(embedded) -> None:
    settings = Settings(request_timeout=2.0, **QUIET)
    app = create_app(settings, loader=lambda _: embedded)
    with serving(app) as base:
        wait_ready(base)
        body = {"messages": MESSAGES, "max_tokens": 300}
        with slowed(app, 2.5), ThreadPoolExecutor(2) as pool:  # every pass outlives the deadline
            # one runs past its deadline, the other waits past it in the queue
            both = list(
                pool.map(
                    lambda _: httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60),
                    range(2),
                )
            )
        for slow in both:
            assert slow.status_code == 504 and slow.json()["error"]["code"] == "timeout"
            assert "2 s" in slow.json()["error"]["message"]
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=10)
        assert_engine_idle(app)
        speculating(app)  # a deadline that falls while a request speculates
        with slowed(app, 0.1):
            copy = {"messages": COPY_LONG, "max_tokens": 400}
            late = httpx.post(f"{base}/v1/chat/completions", json=copy, timeout=60)
        assert late.status_code == 504 and accepted_draft_tokens(base) > 0
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=10)
        assert_engine_idle(app)

        engine = app.state.runtime.engine
        original = engine.runner.forward

        engine.runner.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
        broken = httpx.post(
            f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=60
        )
        assert broken.status_code == 500 and "device lost" in broken.json()["error"]["message"]
        body = {"messages": MESSAGES, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            events = sse_events(response)
        assert (
            "device lost" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        )

        engine.runner.forward = original
        ok = httpx.post(
            f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=60
        )
        assert ok.status_code == 200


# --- lifecycle -----------------------------------------------------------------------


def test_ready_waits_for_the_model_and_health_does_not(embedded) -> None:
    release = threading.Event()

    def slow_loader(_: Settings):
        release.wait(timeout=30)
        return embedded

    with serving(create_app(Settings(**QUIET), loader=slow_loader)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").json()["status"] == "loading"
        busy = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES})
        assert busy.status_code == 503 and "loading" in busy.json()["error"]["message"]
        release.set()
        wait_ready(base)


def test_health_names_a_kernel_fallback_only_when_there_is_one(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "kernels_fallback" not in httpx.get(f"{server}/health").json()
    monkeypatch.setattr(
        packed_linear, "_kernels_error", "ImportError: numba's kernels did not import"
    )
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200  # slower, not broken: the server serves on the fallback
    assert health.json()["kernels_fallback"] == "ImportError: numba's kernels did not import"


def test_failed_load_fails_ready_and_health() -> None:
    def broken_loader(_: Settings):
        raise FileNotFoundError("no model at /nowhere")

    with serving(create_app(Settings(**QUIET), loader=broken_loader)) as base:
        wait_until(lambda: httpx.get(f"{base}/ready").json()["status"] != "loading", timeout=10)
        ready = httpx.get(f"{base}/ready").json()
        assert ready["status"] == "failed" and "/nowhere" in ready["error"]
        # the process can never serve: the liveness probe fails too, so it is restarted
        assert httpx.get(f"{base}/health").status_code == 503


@pytest.mark.parametrize(
    "speculation",
    [
        {"mode": "fixed", "k": 6, "w": 3, "strategy": "context"},
        {"mode": "fixed", "k": 3, "w": 2, "strategy": "extended_bigram"},
        {
            "mode": "auto",
            "k": 8,
            "w": 6,
            "strategy": "mixed",
        },  # no cost profile here: the plain fallback
    ],
)
def test_greedy_text_is_the_same_whatever_the_speculation(server: str, direct, speculation) -> None:
    body = {"messages": MESSAGES, "max_tokens": 24, "speculation": speculation}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == direct(MESSAGES)[0]


@pytest.mark.slow
def test_auto_speculates_on_a_copy_task_and_keeps_the_greedy_text(
    embedded, direct, tmp_path
) -> None:
    """A copy task is where drafts pay even where every token costs (a CPU), so the controller
    must speculate on it, and from the first request: a server with no saved profile prices
    trees with its device class's conservative one until its own is measured (without any,
    auto decodes plainly and accepts nothing)."""
    settings = Settings(
        spec_mode="auto",
        max_tokens=64,
        model_tables=False,
        cost_profile=True,
        default_temperature=0.0,
        cache_dir=tmp_path,
    )
    with serving(create_app(settings, loader=lambda _: embedded)) as base:
        wait_ready(base)
        health = httpx.get(f"{base}/health").json()
        assert health["cost_profile_source"] == "default" and not health["cost_profile"]
        body = {"messages": COPY, "max_tokens": 64, "speculation": {"mode": "auto", "k": 8, "w": 6}}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == direct(COPY, max_tokens=64)[0]
    assert choice["speculative_decoding_stats"]["num_accepted_draft_tokens"] > 0


def test_sampling_with_a_seed_is_reproducible_and_speculation_keeps_it(server: str) -> None:
    def ask(seed: int, speculation: dict) -> str:
        body = {
            "messages": MESSAGES,
            "max_tokens": 24,
            "temperature": 0.9,
            "top_p": 0.95,
            "top_k": 50,
            "seed": seed,
            "speculation": speculation,
        }
        return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][
            0
        ]["message"]["content"]

    plain = ask(7, {"mode": "off"})
    assert ask(7, {"mode": "off"}) == plain
    assert ask(7, {"mode": "fixed", "k": 6, "w": 4}) == plain  # same seed: the very same sample
    assert {ask(seed, {"mode": "off"}) for seed in (1, 2, 3)} != {plain}


def test_penalties_bias_and_min_p_keep_the_plain_text_whatever_the_speculation(
    server: str, embedded, direct
) -> None:
    """Through the openai client: greedy text with every logit control equals the engine's plain
    decoding with the same controls (and differs from it without them); a seeded sample with
    them is the same sample with speculation as without."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    banned = embedded.tokenizer.encode(" 2")[0]
    controls = {
        "frequency_penalty": 0.6,
        "presence_penalty": 0.4,
        "logit_bias": {str(banned): -100},
    }
    extra = {"repetition_penalty": 1.3, "min_p": 0.05}

    def ask(speculation: dict, **sampling) -> str:
        reply = client.chat.completions.create(
            model=embedded.name,
            messages=MESSAGES,
            max_tokens=24,
            **controls,
            **sampling,
            extra_body={**extra, "speculation": speculation},
        )
        accepted.append(
            reply.choices[0].model_extra["speculative_decoding_stats"]["num_accepted_draft_tokens"]
        )
        return reply.choices[0].message.content

    accepted: list[int] = []

    adjusted = SamplingParams(
        frequency_penalty=0.6,
        presence_penalty=0.4,
        repetition_penalty=1.3,
        min_p=0.05,
        logit_bias={banned: -100.0},
    )
    text = direct(MESSAGES, sampling=adjusted)[0]
    assert text != direct(MESSAGES)[0]
    for speculation in (
        {"mode": "off"},
        {"mode": "fixed", "k": 8, "w": 6},
        {"mode": "auto", "k": 8, "w": 6},
    ):
        assert ask(speculation, temperature=0) == text, speculation
    sample = ask({"mode": "off"}, temperature=0.9, seed=7)
    assert ask({"mode": "fixed", "k": 6, "w": 4}, temperature=0.9, seed=7) == sample
    assert accepted[1] > 0 and accepted[-1] > 0  # the fixed trees had drafts accepted


# --- the default CPU path: packed GGUF weights ----------------------------------------


@pytest.fixture(scope="module")
def packed():
    """The embedded model as `make serve` serves it on a CPU: packed Q4_1/Q8_0 weights."""
    from service.model.loader import load_model

    return load_model(quantization="gguf")


@pytest.fixture(scope="module")
def packed_server(packed):
    """A server on the packed weights whose auto mode speculates (a scripted cost profile)."""
    app = create_app(Settings(spec_mode="auto", max_tokens=48, **QUIET), loader=lambda _: packed)
    with serving(app) as base:
        wait_ready(base)
        speculating(app)
        yield base


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "speculation",
    [
        {"mode": "off"},
        {"mode": "fixed", "k": 6, "w": 4, "strategy": "context"},
        {"mode": "auto", "k": 8, "w": 6},
    ],
    ids=["off", "fixed", "auto"],
)
def test_the_packed_cpu_path_answers_the_same_text_whatever_the_speculation(
    packed, packed_server, speculation, stream: bool
) -> None:
    decode = plain_decoding(packed)
    for messages in (MESSAGES, COPY):
        want = decode(messages, max_tokens=48)[0]
        body = {
            "messages": messages,
            "max_tokens": 48,
            "stream": stream,
            "speculation": speculation,
        }
        if stream:
            with httpx.stream(
                "POST", f"{packed_server}/v1/chat/completions", json=body, timeout=120
            ) as response:
                chunks = [json.loads(e) for e in sse_events(response)[:-1]]
            got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        else:
            got = httpx.post(f"{packed_server}/v1/chat/completions", json=body, timeout=120).json()[
                "choices"
            ][0]["message"]["content"]
        assert got == want, (messages, speculation)
    if speculation["mode"] != "off":  # the copy prompt's drafts were accepted: trees were verified
        assert accepted_draft_tokens(packed_server) > 0


@pytest.mark.slow
def test_a_seeded_sample_on_the_packed_path_is_the_same_with_speculation(packed_server) -> None:
    def ask(speculation: dict) -> str:
        body = {
            "messages": COPY,
            "max_tokens": 40,
            "temperature": 0.8,
            "top_p": 0.95,
            "seed": 11,
            "speculation": speculation,
        }
        return httpx.post(f"{packed_server}/v1/chat/completions", json=body, timeout=120).json()[
            "choices"
        ][0]["message"]["content"]

    plain = ask({"mode": "off"})
    assert ask({"mode": "fixed", "k": 6, "w": 4}) == plain and ask({"mode": "auto"}) == plain
