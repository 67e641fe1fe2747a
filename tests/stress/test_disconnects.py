"""A storm of concurrent streams, a quarter of them dropped at random points.

Every stream that is not dropped must end with its full text (the same text as the prompt
alone gives), a finish reason and `[DONE]`; afterwards the queue and the KV cache are back to
idle, a second storm leaves the process's memory where the first left it, and nothing was
logged at error level. Loopback only; bounded in count and time.

Size: 16 clients, 48 requests by default; `NGRAMMYS_STRESS_FULL=1` (or `pytest --full`): 64
clients, 500 requests. The figures are printed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time

import httpx
import psutil

from app.background import serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import QUIET, wait_ready, wait_until

FULL = os.environ.get("NGRAMMYS_STRESS_FULL") == "1"
CLIENTS, REQUESTS = (64, 500) if FULL else (16, 48)
DROP_SHARE = 0.25
MAX_TOKENS = 24
PROMPTS = [f"Tell me about the number {n}." for n in range(6)]
# What a second storm may add to the process's memory: it added ~1 MiB where the first, growing
# the allocators' pools and buffers, added 13-15 MiB; a round's retained logits would add far more
RSS_GROWTH_LIMIT = 16 * 2**20


async def stream(
    client: httpx.AsyncClient, prompt: str, drop_after: int | None
) -> tuple[str, list[str]]:
    """('done', events) or ('dropped', events read before leaving)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    events: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if drop_after is not None and len(events) >= drop_after:
                    return "dropped", events  # leaving the block closes the connection
    return "done", events


def text_of(events: list[str]) -> tuple[str, str | None]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    return text, chunks[-1]["choices"][0]["finish_reason"]


async def storm(base: str, expected: dict[str, str], seed: int) -> list[float]:
    rng = random.Random(seed)
    jobs: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()
    for index in range(REQUESTS):
        drop = rng.randint(1, 6) if rng.random() < DROP_SHARE else None
        jobs.put_nowait((PROMPTS[index % len(PROMPTS)], drop))
    latencies: list[float] = []
    async with httpx.AsyncClient(
        base_url=base, timeout=120, limits=httpx.Limits(max_connections=CLIENTS + 4)
    ) as client:

        async def worker() -> None:
            while not jobs.empty():
                prompt, drop = jobs.get_nowait()
                started = time.perf_counter()
                outcome, events = await stream(client, prompt, drop)
                if outcome == "done":
                    latencies.append(time.perf_counter() - started)
                    assert events[-1] == "[DONE]"
                    text, finish = text_of(events[:-1])
                    assert finish in ("length", "stop") and text == expected[prompt]

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return latencies


def test_a_disconnect_storm_loses_nothing_and_leaks_nothing(tiny_served, caplog) -> None:
    settings = Settings(
        max_running_requests=CLIENTS,
        max_waiting=CLIENTS * 2,
        default_temperature=0.0,
        **{k: v for k, v in QUIET.items() if k != "default_temperature"},
    )
    app = create_app(settings, loader=lambda _: tiny_served)
    process = psutil.Process()
    with serving(app) as base, caplog.at_level(logging.ERROR):
        wait_ready(base)
        expected = {}
        for prompt in PROMPTS:  # each prompt alone: the text every full stream must repeat
            outcome, events = asyncio.run(_alone(base, prompt))
            expected[prompt] = text_of(events[:-1])[0]
        # a first storm grows the allocators' pools and the KV buffers' capacity; a second one
        # that keeps what the first left shows a leak
        rss = [process.memory_info().rss]
        for seed in (0, 1):
            started = time.perf_counter()
            latencies = asyncio.run(storm(base, expected, seed))
            seconds = time.perf_counter() - started
            wait_until(lambda: _is_idle(httpx.get(f"{base}/health").json()), timeout=30)
            engine = app.state.runtime.engine
            assert (
                engine.cache.nbytes == 0
                and not engine.scheduler.running
                and not engine.scheduler.waiting
            )
            rss.append(process.memory_info().rss)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    latencies.sort()
    completed = len(latencies)
    print(
        f"\ndisconnect storm (the second): {REQUESTS} requests, {CLIENTS} clients, "
        f"{REQUESTS - completed} dropped, {completed} complete in {seconds:.1f} s; latency p50 "
        f"{latencies[completed // 2]:.2f} s, p99 "
        f"{latencies[min(int(completed * 0.99), completed - 1)]:.2f} s; RSS "
        f"{' → '.join(f'{r / 2**20:.0f}' for r in rss)} MiB over two storms; KV after: "
        f"{engine.cache.nbytes} bytes"
    )
    assert REQUESTS * 0.6 < completed < REQUESTS
    assert rss[2] - rss[1] < RSS_GROWTH_LIMIT, "the second storm left memory behind"


def _is_idle(health: dict) -> bool:
    return health["requests_running"] == 0 and health["requests_waiting"] == 0


async def _alone(base: str, prompt: str) -> tuple[str, list[str]]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await stream(client, prompt, None)
