"""`ngrammys schemas`: an interactive request's latency alone, and while hostile JSON schemas
arrive at a steady rate, against one server.

The hostile requests alternate two kinds, each schema new (its property names salted), so no
cache helps: large (objects nested 12 deep, about 470 KB, under the default 1 MiB body limit)
and slow (about 50 KB of patterned strings whose compile takes seconds). They are sent from a
thread pool at a fixed rate whatever their answers take. The interactive request (8 greedy
tokens, no schema) runs one at a time, alone, then under the load, then alone again; the figure
is the ratio of the medians.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPT = [{"role": "user", "content": "List the first five prime numbers."}]
INTERACTIVE_TOKENS = 8
REQUEST_TIMEOUT = 600.0
# a hostile request's: where compiles are unbounded the measurement's end waits no longer for them
HOSTILE_TIMEOUT = 60.0


@dataclass(frozen=True)
class Outcome:
    """The interactive request's latencies alone and under the load (seconds), and the
    hostile requests' answers by kind and status."""

    alone: list[float]
    loaded: list[float]
    hostile: dict[str, int]

    @property
    def ratio(self) -> float:
        return statistics.median(self.loaded) / statistics.median(self.alone)


def large_schema(salt: int, depth: int = 12, leaves: int = 550) -> dict[str, Any]:
    """Objects nested `depth` deep, each with `leaves` typed fields beside the next."""
    if depth == 0:
        return {"type": "integer"}
    properties: dict[str, Any] = {
        f"s{salt}_{depth}_{i}": {"type": ["string", "integer", "null"]} for i in range(leaves)
    }
    properties[f"o{salt}_{depth}"] = large_schema(salt, depth - 1, leaves)
    return {"type": "object", "properties": properties, "required": list(properties)}


def slow_schema(salt: int, depth: int = 8) -> dict[str, Any]:
    """Three patterned strings an object, two of them objects again, `depth` deep: small text,
    a compile time that triples a level."""
    if depth == 0:
        return {"type": "string", "pattern": f"[a-z]{{1,{8 + salt % 5}}}"}
    properties = {
        f"k{salt}_{depth}_{i}": slow_schema(salt + i, depth - 1 if i < 2 else 0) for i in range(3)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def _body(schema: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": PROMPT,
        "max_tokens": INTERACTIVE_TOKENS,
        "temperature": 0.0,
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "hostile", "schema": schema},
        }
    return body


def _latency(client: httpx.Client) -> float:
    began = time.perf_counter()
    response = client.post("/v1/chat/completions", json=_body(None))
    response.raise_for_status()
    return time.perf_counter() - began


def _hostile_bodies() -> Iterator[tuple[str, bytes]]:
    """Serialized ahead of sending, so building them does not take the client's time."""
    salt = 0
    while True:
        salt += 1
        yield "large", json.dumps(_body(large_schema(salt * 1000))).encode()
        yield "slow", json.dumps(_body(slow_schema(salt * 1000))).encode()


def measure(base: str, rate: float, seconds: float, repeats: int) -> Outcome:
    """`repeats` interactive requests alone, then as many as fit in `seconds` of `rate` hostile
    requests a second (at least `repeats`), then `repeats` alone again. The hostile answers are
    counted as they stood when the last loaded request ended ("sent": all sent by then)."""
    headers = {"content-type": "application/json"}
    answers: Counter[str] = Counter()
    lock = threading.Lock()
    # the hostile requests have a client of their own: no wait for a pooled connection
    hostile_client = httpx.Client(
        base_url=base, timeout=HOSTILE_TIMEOUT, limits=httpx.Limits(max_connections=None)
    )
    with hostile_client, httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT) as client:
        _latency(client)  # warm
        alone = [_latency(client) for _ in range(repeats)]
        bodies = _hostile_bodies()
        prepared = [next(bodies) for _ in range(int(rate * seconds) + 1)]
        stop = threading.Event()

        def send(kind: str, body: bytes) -> None:
            try:
                response = hostile_client.post(
                    "/v1/chat/completions", content=body, headers=headers
                )
                status = str(response.status_code)
            except httpx.HTTPError as error:
                status = type(error).__name__
            with lock:
                answers[f"{kind} {status}"] += 1

        def arrive(pool: ThreadPoolExecutor) -> None:
            began = time.perf_counter()
            for index, (kind, body) in enumerate(prepared):
                wait = began + index / rate - time.perf_counter()
                if stop.wait(max(wait, 0.0)):
                    return
                with lock:
                    answers["sent"] += 1
                pool.submit(send, kind, body)

        pool = ThreadPoolExecutor(max_workers=256)
        arrivals = threading.Thread(target=arrive, args=(pool,))
        arrivals.start()
        began = time.perf_counter()
        loaded: list[float] = []
        while len(loaded) < repeats or time.perf_counter() - began < seconds:
            loaded.append(_latency(client))
        stop.set()
        arrivals.join()
        with lock:
            hostile = dict(sorted(answers.items()))
        # alone again once the hostile requests sent are answered: the machine's drift during
        # the run is in both medians, not in the ratio
        pool.shutdown(wait=True, cancel_futures=True)
        alone += [_latency(client) for _ in range(repeats)]
    return Outcome(alone, loaded, hostile)


def report(outcome: Outcome, rate: float) -> str:
    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f} ms median, {max(values) * 1000:.0f} max"

    return "\n".join(
        [
            f"interactive ({INTERACTIVE_TOKENS} tokens) alone: {ms(outcome.alone)} "
            f"({len(outcome.alone)} requests)",
            f"interactive under {rate:g} hostile schemas/s: {ms(outcome.loaded)} "
            f"({len(outcome.loaded)} requests)",
            f"ratio (median under load / alone): {outcome.ratio:.2f}x",
            "hostile answers: " + ", ".join(f"{k}: {n}" for k, n in outcome.hostile.items()),
        ]
    )


def run_command(
    server: AbstractContextManager[str],
    rate: float,
    seconds: float,
    repeats: int,
    json_path: Path | None,
) -> None:
    with server as base:
        outcome = measure(base, rate, seconds, repeats)
    print(report(outcome, rate))
    if json_path is not None:
        json_path.write_text(json.dumps({**asdict(outcome), "ratio": outcome.ratio}, indent=2))
