"""`ngrammys soak`: minutes of mixed traffic against one server, reported window by window.

`clients` clients each send their planned requests (`soak_traffic.plan`) one after another until
the run's time is up; at the end of every window the server's memory is read from its /metrics:
its resident memory, the running requests' KV, the prefix cache and the suffix index. A request
belongs to the window it ends in (the last window takes those still running when time is up).
The report (`soak_report`) judges the goals.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

from service.bench.loadtest import wait_warm
from service.bench.soak_report import (
    HEADER,
    ServerSample,
    SoakReport,
    Window,
    format_report,
    window_row,
    write_json,
)
from service.bench.soak_traffic import Outcome, plan, send

REQUEST_TIMEOUT = 300.0  # seconds; past it a request counts as unanswered


def metric(text: str, name: str) -> float | None:
    """The value of the unlabelled series `name` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


async def sample_server(client: httpx.AsyncClient, api_key: str) -> ServerSample:
    """The server's memory now; a figure it does not give (or a failed scrape) is None."""
    try:
        response = await client.get("/metrics", headers={"Authorization": f"Bearer {api_key}"})
        text = response.text if response.status_code == 200 else ""
    except httpx.TransportError:
        text = ""
    return ServerSample(
        metric(text, "process_resident_memory_bytes"),
        metric(text, "ngrammys_kv_cache_usage_perc"),
        metric(text, "ngrammys_kv_cache_bytes"),
        metric(text, "ngrammys_prefix_cache_bytes"),
        metric(text, "ngrammys_suffix_index_bytes"),
    )


async def soak(
    base_url: str,
    api_key: str,
    seconds: float,
    window_seconds: float,
    clients: int,
    max_tokens: int,
    progress: Callable[[str], None] = lambda row: None,
) -> SoakReport:
    """Run the mixed traffic for `seconds` against `base_url` (a server with `api_key`),
    `progress` told each window's row as it closes."""
    windows = max(1, math.ceil(seconds / window_seconds))
    outcomes: list[Outcome] = []
    samples: list[ServerSample] = []
    started = time.monotonic()
    deadline = started + seconds
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=REQUEST_TIMEOUT, limits=limits
    ) as client:

        async def client_loop(index: int) -> None:
            for planned in plan(index):
                if time.monotonic() >= deadline:
                    return
                outcomes.append(await send(client, planned, api_key, max_tokens))

        async def sampler() -> None:
            for index in range(windows):
                end = started + min((index + 1) * window_seconds, seconds)
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                samples.append(await sample_server(client, api_key))
                window = _window(index, started, window_seconds, seconds, outcomes, samples)
                progress(window_row(window))

        await asyncio.gather(sampler(), *(client_loop(i) for i in range(clients)))
    report_windows = [
        _window(i, started, window_seconds, seconds, outcomes, samples, last=i == windows - 1)
        for i in range(windows)
    ]
    return SoakReport.of(report_windows, outcomes)


def _window(
    index: int,
    started: float,
    window_seconds: float,
    seconds: float,
    outcomes: list[Outcome],
    samples: list[ServerSample],
    last: bool = False,
) -> Window:
    """Window `index` of a run of `seconds` (`last`: with every outcome after it too)."""
    begin, end = index * window_seconds, min((index + 1) * window_seconds, seconds)
    inside = [
        o
        for o in outcomes
        if begin <= o.finished - started and (last or o.finished - started < end)
    ]
    return Window.of(index, end, inside, samples[min(index, len(samples) - 1)])


def run_command(
    server: AbstractContextManager[str],
    api_key: str,
    minutes: float,
    window_seconds: float,
    clients: int,
    max_tokens: int,
    json_path: Path | None,
) -> bool:
    """`ngrammys soak`: the run against the server `server` yields, from the moment it is
    ready, a row a window as it closes, then the report; whether every goal held. The server's
    warm-up (its draft tables, its cost profile: on a busy machine a measurement may be retried
    for long) is not waited for: it runs in the first window, which the goals leave out."""
    with server as base:
        wait_warm(base, warm_up=False)
        print(
            f"{minutes:g} min of mixed traffic from {clients} clients, windows of "
            f"{window_seconds:g} s, {max_tokens} tokens at most a request; server {base}\n",
            flush=True,
        )
        print(HEADER, flush=True)
        report = asyncio.run(
            soak(
                base,
                api_key,
                minutes * 60,
                window_seconds,
                clients,
                max_tokens,
                progress=lambda row: print(row, flush=True),
            )
        )
    print(f"\n{format_report(report)}", flush=True)
    if json_path:
        write_json(
            report,
            json_path,
            minutes=minutes,
            window_seconds=window_seconds,
            clients=clients,
            max_tokens=max_tokens,
        )
        print(f"wrote {json_path}")
    return report.passed
