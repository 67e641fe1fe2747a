"""Around an app served by `app.background.serving`: the chat messages and settings the HTTP
tests send, waits for the server, posting and OpenAI's error shape, the SSE framing check, a slowed
engine and an ASGI 2.4 shim."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from fastapi import FastAPI

from app.background import serving
from service.runtime import Runtime
from tests.helpers.costs import MEMORY_BOUND

MESSAGES = [{"role": "user", "content": "List the first five prime numbers."}]
LONG = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
ESSAY = (
    "The harbour town woke early. Fishing boats left before dawn, their lamps swinging over black "
    "water, and the bakery on the square lit its ovens at four. By seven the market stalls were "
    "up: apples from the valley farms, cheese wrapped in cloth, knives sharpened while you waited. "
    "The ferry to the island ran twice a day, at nine and at three, and the captain knew every "
    "passenger by name. In winter the storms came from the west and the town closed its shutters; "
    "in summer the visitors came from the east and the town opened everything it had. The old "
    "lighthouse had not been used for forty years, but the children still climbed its stairs to "
    "count the ships, and the council still argued every spring about who should pay to paint it."
)
# drafts from the context pay
COPY_LONG = [{"role": "user", "content": f"Repeat this text word for word:\n\n{ESSAY}"}]
# greedy by default (so texts compare with the engine's), no background warm-up in tests
QUIET = {"model_tables": False, "cost_profile": False, "default_temperature": 0.0}


def wait_until(predicate: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def wait_ready(base: str) -> None:
    wait_until(lambda: httpx.get(f"{base}/ready").status_code == 200)


@contextmanager
def serving_ready(app: FastAPI) -> Iterator[str]:
    """`serving(app)`, from the moment its model has loaded."""
    with serving(app) as base:
        wait_ready(base)
        yield base


def sse_events(response: httpx.Response) -> list[str]:
    """Raw `data:` payloads, checking the framing of every event on the way."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: ") :] for e in events]


def post(
    base: str, route: str, body: dict | None = None, raw: bytes | str | None = None, **kwargs
) -> httpx.Response:
    """POST `body` (or the `raw` bytes) as JSON to /v1/`route`."""
    content = raw if raw is not None else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{base}/v1/{route}", content=content, headers=headers, timeout=60, **kwargs)


def assert_openai_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    """`response` is an error of `status` in OpenAI's shape, naming `param`; its fields."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def runtime_of(app: FastAPI) -> Runtime:
    """The app's runtime, once it has loaded its engine in the background."""
    deadline = time.monotonic() + 60
    while getattr(app.state, "runtime", None) is None:
        assert time.monotonic() < deadline, "the app's engine did not load within 60 s"
        time.sleep(0.01)
    return app.state.runtime


def speculating(app: FastAPI) -> None:
    """Give the app's engine a cost profile under which drafts pay (a device below its
    knee), so its auto requests speculate on any machine: the faults the edge handles (a
    client gone, a deadline, a full queue) then meet requests in the middle of a tree."""
    runtime_of(app).engine.profile = MEMORY_BOUND


def accepted_draft_tokens(base: str) -> float:
    """Drafted tokens the server's engine accepted so far (its metrics)."""
    text = httpx.get(f"{base}/metrics").text
    return sum(
        float(v)
        for v in re.findall(
            r"^ngrammys_spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", text, re.M
        )
    )


def assert_engine_idle(app: FastAPI) -> None:
    """Nothing running or queued, and the KV cache holds no bytes."""
    engine = runtime_of(app).engine
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.cache.nbytes == 0


@contextmanager
def slowed(app: FastAPI, seconds: float) -> Iterator[None]:
    """Make every forward pass of the app's engine take `seconds` longer.

    Tests of timeouts, queueing and disconnects need a request that is still running when
    they look; slowing the pass makes that hold on a machine of any speed.
    """
    runner = runtime_of(app).engine.runner
    original = runner.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    runner.forward = slow_forward
    try:
        yield
    finally:
        runner.forward = original


class Asgi24:
    """Serves `app` as an ASGI 2.4 server would, on top of uvicorn (which speaks 2.3).

    Under 2.4 a `send` after the client left raises `OSError`, and Starlette, relying on
    that, stops listening for `http.disconnect` while it streams (so a response is ended by
    the first failing send, possibly before its body iterator ever started). uvicorn instead
    drops such sends silently; this wrapper watches for the disconnect once the request body
    is in and raises from `send` from then on.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def receive_body():
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                # the body is in: only a disconnect is left
                watcher.append(asyncio.ensure_future(watch()))
            return message

        async def checked_send(message) -> None:
            if gone.is_set():
                raise OSError("the client disconnected")
            await send(message)

        watcher: list[asyncio.Future] = []
        try:
            await self.app(scope, receive_body, checked_send)
        finally:
            for task in watcher:
                task.cancel()
