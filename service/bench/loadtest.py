"""`ngrammys loadtest`: C concurrent streaming clients against the HTTP server.

For each concurrency C, speculation off and auto run back to back on the same server (their
order alternating between C values and between repeats, so with two repeats each C runs
off-auto-auto-off or auto-off-off-auto), each client sending Spec-Bench questions one after
another. The dev machines are shared and drift by several % between two identical runs, more
than auto and off differ by at large C, so `--repeats` and the mean of each mode over its runs
(`format_comparison`) are how an auto/off ratio is stated. Per (C, mode): requests/s, output
tokens/s, and p50/p99 of the time to first token and of the inter-token latency. Every chunk
carries the usage so far (`stream_options.continuous_usage_stats`), so a chunk of several
tokens counts as that many tokens sharing the gap: ITL is per token, as clients of a
speculative server see it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.bench.specbench import Question, specbench_questions

MODES = ("off", "auto")


@dataclass
class RequestTiming:
    ttft: float
    itl: list[float]  # one per token after the first
    tokens: int
    seconds: float
    passes: int = 0  # verification passes (rounds) the request took
    drafted: int = 0  # tree nodes drafted over all its rounds
    text: str = ""  # the answer


@dataclass
class LoadResult:
    concurrency: int
    mode: str
    requests: int
    seconds: float
    timings: list[RequestTiming] = field(default_factory=list, repr=False)
    repeat: int = 0  # which of the repeats of this (C, mode)

    @property
    def output_tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    def summary(self) -> dict[str, float | int | str]:
        ttft = [t.ttft for t in self.timings]
        itl = [x for t in self.timings for x in t.itl] or [0.0]
        passes = sum(t.passes for t in self.timings) or 1
        return {
            "concurrency": self.concurrency,
            "mode": self.mode,
            "repeat": self.repeat,
            "requests": self.requests,
            "requests_per_second": self.requests / self.seconds,
            "output_tokens_per_second": self.output_tokens / self.seconds,
            "ttft_p50_ms": quantile(ttft, 0.5) * 1e3,
            "ttft_p99_ms": quantile(ttft, 0.99) * 1e3,
            "itl_p50_ms": quantile(itl, 0.5) * 1e3,
            "itl_p99_ms": quantile(itl, 0.99) * 1e3,
            "tokens_per_pass": self.output_tokens / passes,
            "drafted_per_pass": sum(t.drafted for t in self.timings) / passes,
        }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def stream_chat(
    client: httpx.AsyncClient, messages: list[dict[str, str]], mode: str, max_tokens: int
) -> RequestTiming:
    """One greedy chat request, streamed, timed token by token."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "speculation": {"mode": mode},
    }
    started = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens = 0
    stats: dict = {}
    text: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage")
            for choice in chunk.get("choices", []):  # the last chunk of a choice carries the stats
                stats = choice.get("speculative_decoding_stats") or stats
                text.append((choice.get("delta") or {}).get("content") or "")
            if not usage or usage["completion_tokens"] == tokens:
                continue
            now, new = time.perf_counter(), usage["completion_tokens"] - tokens
            if first is None:
                first = now
                itl.extend([0.0] * (new - 1))  # tokens that came with the first
            else:
                itl.extend([(now - last) / new] * new)  # type: ignore[operator]
            last, tokens = now, usage["completion_tokens"]
    end = time.perf_counter()
    return RequestTiming(
        (first or end) - started,
        itl,
        tokens,
        end - started,
        stats.get("num_spec_steps", 0),
        stats.get("num_draft_tokens", 0),
        "".join(text),
    )


async def run_level(
    base_url: str,
    questions: list[Question],
    concurrency: int,
    mode: str,
    requests: int,
    max_tokens: int,
) -> LoadResult:
    """`requests` requests from `concurrency` clients, each sending its next one when done."""
    queue: asyncio.Queue[Question] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(questions[index % len(questions)])
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:

        async def client_loop() -> None:
            while not queue.empty():
                question = queue.get_nowait()
                timings.append(
                    await stream_chat(
                        client, [{"role": "user", "content": question.text}], mode, max_tokens
                    )
                )

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return LoadResult(concurrency, mode, requests, seconds, timings)


def run_loadtest(
    base_url: str,
    questions: list[Question],
    levels: list[int],
    requests_per_client: int,
    max_tokens: int,
    progress=print,
    modes: tuple[str, ...] = MODES,
    repeats: int = 1,  # type: ignore[no-untyped-def]
) -> list[LoadResult]:
    """Every concurrency level, each mode back to back, `repeats` times (order alternating
    between levels and between repeats)."""
    results = []
    for index, concurrency in enumerate(levels):
        for repeat in range(repeats):
            for mode in modes if (index + repeat) % 2 == 0 else modes[::-1]:
                requests = max(concurrency * requests_per_client, 4)
                result = asyncio.run(
                    run_level(base_url, questions, concurrency, mode, requests, max_tokens)
                )
                result.repeat = repeat
                progress(_row(result.summary()))
                results.append(result)
    return results


def wait_warm(base: str, warm_up: bool) -> None:
    """Until /ready, and (`warm_up`: for a server started here) until its cost profile and tables
    exist."""
    while True:
        ready = httpx.get(f"{base}/ready", timeout=10).status_code == 200
        health = httpx.get(f"{base}/health", timeout=10).json()
        if ready and (not warm_up or (health.get("cost_profile") and health.get("model_tables"))):
            return
        time.sleep(1)


def run_command(
    server: AbstractContextManager[str],
    warm_up: bool,
    dataset: Path,
    per_category: int,
    levels: list[int],
    requests_per_client: int,
    max_tokens: int,
    modes: tuple[str, ...],
    repeats: int,
    max_running_requests: int,
    json_path: Path | None,
    png: Path | None,
) -> None:
    """`ngrammys loadtest`: the load test against the server `server` yields (warmed up first
    when `warm_up`), a row a run as it ends, then the comparison (`max_running_requests`, the
    server's batch, goes into the JSON beside the run's own figures)."""
    questions = specbench_questions(dataset, per_category)
    with server as base:
        wait_warm(base, warm_up)
        print(
            f"{len(questions)} questions, {max_tokens} tokens each, greedy; server {base}\n",
            flush=True,
        )
        print(HEADER, flush=True)
        results = run_loadtest(
            base,
            questions,
            levels,
            requests_per_client,
            max_tokens,
            progress=lambda row: print(row, flush=True),
            modes=modes,
            repeats=repeats,
        )
    print(f"\n{format_comparison(results)}", flush=True)
    if json_path:
        write_json(
            results,
            json_path,
            max_tokens=max_tokens,
            per_category=per_category,
            max_running_requests=max_running_requests,
            repeats=repeats,
        )
        print(f"wrote {json_path}")
    if png:
        write_plot(results, png, f"{max_tokens} tokens per request, greedy")
        print(f"wrote {png}")


def _runs(results: list[LoadResult]) -> dict[tuple[int, str], list[float]]:
    """Output tokens/s of every run of each (C, mode), in run order."""
    runs: dict[tuple[int, str], list[float]] = {}
    for result in results:
        runs.setdefault((result.concurrency, result.mode), []).append(
            result.output_tokens / result.seconds
        )
    return runs


def mean_tokens_per_second(results: list[LoadResult]) -> dict[tuple[int, str], float]:
    """Output tokens/s of each (C, mode), averaged over its repeats."""
    return {key: statistics.fmean(values) for key, values in _runs(results).items()}


def format_comparison(results: list[LoadResult]) -> str:
    """Per C: each mode's mean output tokens/s over its repeats (every run listed) and, when
    both ran, auto over off."""
    runs, means = _runs(results), mean_tokens_per_second(results)
    modes = list(dict.fromkeys(r.mode for r in results))
    lines = [
        f"| C | {' | '.join(f'{m} tok/s (runs)' for m in modes)} | auto/off |",
        f"|---|{'---|' * len(modes)}---|",
    ]
    for concurrency in dict.fromkeys(r.concurrency for r in results):
        cells = [
            (
                f"{means[(concurrency, mode)]:.1f} "
                f"({', '.join(f'{x:.1f}' for x in runs[(concurrency, mode)])})"
            )
            for mode in modes
        ]
        ratio = (
            f"{means[(concurrency, 'auto')] / means[(concurrency, 'off')]:.2f}x"
            if {(concurrency, "auto"), (concurrency, "off")} <= means.keys()
            else "-"
        )
        lines.append(f"| {concurrency} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


HEADER = (
    "| C | mode | repeat | requests | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
    "| ITL p50 (ms) | ITL p99 (ms) "
    "| tokens/pass | drafted/pass |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(s: dict[str, float | int | str]) -> str:
    return (
        f"| {s['concurrency']} | {s['mode']} | {s['repeat']} | {s['requests']} "
        f"| {s['requests_per_second']:.2f} "
        f"| {s['output_tokens_per_second']:.1f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} "
        f"| {s['itl_p50_ms']:.0f} | {s['itl_p99_ms']:.0f} | {s['tokens_per_pass']:.2f} "
        f"| {s['drafted_per_pass']:.1f} |"
    )


def format_table(results: list[LoadResult]) -> str:
    return "\n".join([HEADER, *(_row(r.summary()) for r in results)])


def write_json(results: list[LoadResult], path: Path, **run: object) -> None:
    path.write_text(json.dumps({"run": run, "levels": [r.summary() for r in results]}, indent=2))


def write_plot(results: list[LoadResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r.mode for r in results):
        rows = [r.summary() for r in results if r.mode == mode]
        levels = list(dict.fromkeys(row["concurrency"] for row in rows))

        def mean(key: str) -> list[float]:
            return [
                statistics.fmean(row[key] for row in rows if row["concurrency"] == c)
                for c in levels
            ]  # type: ignore[misc]

        left.plot(levels, mean("output_tokens_per_second"), marker="o", label=f"speculation {mode}")
        right.plot(levels, mean("itl_p99_ms"), marker="o", label=f"speculation {mode}")
    for axes, label in (
        (left, "output tokens/s (mean of repeats)"),
        (right, "p99 inter-token latency (ms)"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent clients C")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
