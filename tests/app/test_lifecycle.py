"""The model loads on a thread that ends; a request whose client left stops costing anything;
SIGTERM drains before the exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.background import free_port, serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import (
    COPY_LONG,
    MESSAGES,
    QUIET,
    accepted_draft_tokens,
    assert_engine_idle,
    slowed,
    speculating,
    wait_ready,
    wait_until,
)

# The embedded model writes thousands of tokens for this (it reached max_tokens=300 greedy
# with float32 and packed weights alike), far past any drain timeout here; LONG ends by itself
# after 122 tokens, which the packed CPU path decodes within the 8 s drain.
ENDLESS = [{"role": "user", "content": "Write the numbers from 1 to 5000, separated by commas."}]


def test_the_model_loads_on_a_thread_that_ends_once_the_engine_runs(embedded) -> None:
    """A thread that computed keeps its OpenMP worker pool while it lives; only the engine's
    worker may outlive the load with one (`app.main.in_passing_thread`)."""
    loaders: list[threading.Thread] = []

    def loader(_settings: Settings):
        loaders.append(threading.current_thread())
        return embedded

    with serving(create_app(Settings(**QUIET), loader=loader)) as base:
        wait_ready(base)
        (thread,) = loaders
        assert thread is not threading.main_thread()
        wait_until(lambda: not thread.is_alive(), timeout=10)
        response = httpx.post(
            f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=60
        )
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(embedded) -> None:
    app = create_app(Settings(**QUIET), loader=lambda _: embedded)
    with serving(app) as base, slowed(app, 0.2):
        wait_ready(base)
        speculating(app)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{base}/v1/chat/completions",
                json={"messages": COPY_LONG, "max_tokens": 400},
                timeout=3,
            )
        # gone within a poll and a pass, long before 400 tokens (at least 0.2 s each)
        wait_until(lambda: httpx.get(f"{base}/health").json()["requests_running"] == 0, timeout=30)
        metrics = httpx.get(f"{base}/metrics").text
        assert 'ngrammys_requests_total{status="aborted"} 1.0' in metrics
        generated = float(
            re.search(r"^ngrammys_generation_tokens_total (\S+)$", metrics, re.M).group(1)
        )
        assert (
            0 < accepted_draft_tokens(base) and generated < 200
        )  # it left while the request speculated
        assert_engine_idle(app)


@pytest.mark.slow
def test_sigterm_lets_running_requests_finish_and_ends_the_rest_with_an_error() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-model-tables",
            "--no-cost-profile",
            "--default-temperature",
            "0",
            # every round drafts (no cost profile needed): the drain meets requests mid-speculation
            "--spec-mode",
            "fixed",
            "--spec-k",
            "4",
            "--spec-w",
            "4",
            # draining does not depend on the weights' path; the packed one would first compile its
            # kernels on a fresh machine (~60 s idle, past 120 s on a busy CI machine)
            "--quantization",
            "none",
            "--drain-timeout",
            "8",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_until(lambda: _ready(base), timeout=300)
        short = {"messages": MESSAGES, "max_tokens": 4}
        endless = {"messages": ENDLESS, "max_tokens": 4000}
        with ThreadPoolExecutor(4) as pool:
            finished = pool.submit(
                httpx.post, f"{base}/v1/chat/completions", json=short, timeout=60
            )
            cut = pool.submit(httpx.post, f"{base}/v1/chat/completions", json=endless, timeout=60)
            stream = pool.submit(_stream_events, base, endless)
            wait_until(
                lambda: httpx.get(f"{base}/health").json()["requests_running"] >= 2, timeout=30
            )
            wait_until(lambda: accepted_draft_tokens(base) > 0, timeout=60)
            server.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{base}/ready").status_code == 503, timeout=5)
            refused = httpx.post(f"{base}/v1/chat/completions", json=short, timeout=10)
            assert refused.status_code == 503
            assert finished.result().status_code == 200  # accepted before: answered in full
            assert finished.result().json()["usage"]["completion_tokens"] == 4
            assert (
                cut.result().status_code == 503
                and cut.result().json()["error"]["code"] == "shutting_down"
            )
            events = stream.result()
            assert (
                "shut down" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
            )
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _stream_events(base: str, body: dict) -> list[str]:
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body | {"stream": True}, timeout=60
    ) as response:
        return [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
