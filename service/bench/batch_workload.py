"""`ngrammys loadtest --workload batch`: a batch job against the same requests sent by a client,
and interactive latency with a batch running beside it.

The lines are Spec-Bench's extraction and summarization questions (cycled to `--lines`), greedy,
`--max-tokens` each, with the speculation mode asked for. Four settings, each on a server of its
own started here (fresh suffix index and prefix cache: none profits from another's run):

- `batch`: the lines as one batch through the Files and Batches APIs, from create to
  `completed`; tokens a pass over the first `WARM_LINES` lines and over the rest (what the
  suffix index, learning across lines, adds);
- `client C=16`: the same bodies sent by 16 concurrent clients to the chat route;
- `interactive`: 2 clients streaming chat requests (Spec-Bench's qa and writing questions);
- `interactive + batch`: the same, started once the batch runs; how far the batch got
  meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.bench.loadtest import LoadResult, run_level, wait_warm
from service.bench.specbench import Question

BATCH_CATEGORIES = ("extraction", "summarization")
INTERACTIVE_CATEGORIES = ("qa", "writing")
CLIENT_CONCURRENCY = 16
INTERACTIVE_CONCURRENCY = 2
WARM_LINES = 100  # lines the suffix index has seen before "after"
POLL_SECONDS = 0.5


@dataclass
class BatchRun:
    lines: int
    seconds: float
    tokens: int
    tokens_per_pass_first: float  # lines [0, WARM_LINES)
    tokens_per_pass_after: float  # lines [WARM_LINES, ...)

    def summary(self) -> dict[str, Any]:
        return {
            "setting": "batch",
            "lines": self.lines,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens / self.seconds,
            "tokens_per_pass_first": self.tokens_per_pass_first,
            "tokens_per_pass_after": self.tokens_per_pass_after,
        }


def batch_questions(questions: list[Question], lines: int) -> list[Question]:
    """The batch's questions: its categories', cycled to `lines`."""
    chosen = [q for q in questions if q.category in BATCH_CATEGORIES]
    if not chosen:
        raise ValueError(f"the questions file has no {' or '.join(BATCH_CATEGORIES)} questions")
    return list(itertools.islice(itertools.cycle(chosen), lines))


def interactive_questions(questions: list[Question]) -> list[Question]:
    chosen = [q for q in questions if q.category in INTERACTIVE_CATEGORIES]
    return chosen or questions


def _body(question: Question, max_tokens: int, mode: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": question.text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "speculation": {"mode": mode},
    }


def start_batch(client: httpx.Client, questions: list[Question], max_tokens: int, mode: str) -> str:
    """Upload the lines and create their batch; its id."""
    lines = [
        {
            "custom_id": str(i),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": _body(q, max_tokens, mode),
        }
        for i, q in enumerate(questions)
    ]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    uploaded = client.post(
        "/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"}
    )
    uploaded.raise_for_status()
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    created.raise_for_status()
    return str(created.json()["id"])


def run_batch(base: str, questions: list[Question], max_tokens: int, mode: str) -> BatchRun:
    """The batch from its creation to `completed`, and its lines' tokens a pass."""
    with httpx.Client(base_url=base, timeout=600) as client:
        started = time.perf_counter()
        batch_id = start_batch(client, questions, max_tokens, mode)
        while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in (
            "completed",
            "failed",
            "expired",
            "cancelled",
        ):
            time.sleep(POLL_SECONDS)
        seconds = time.perf_counter() - started
        if batch["status"] != "completed" or batch["error_file_id"]:
            raise RuntimeError(f"the batch ended {batch['status']}: {batch}")
        output = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    records = [json.loads(row) for row in output.splitlines()]
    tokens = [r["response"]["body"]["usage"]["completion_tokens"] for r in records]
    passes = [
        r["response"]["body"]["choices"][0]["speculative_decoding_stats"]["num_spec_steps"]
        for r in records
    ]
    first, after = slice(0, WARM_LINES), slice(WARM_LINES, None)
    return BatchRun(
        len(records),
        seconds,
        sum(tokens),
        sum(tokens[first]) / max(sum(passes[first]), 1),
        sum(tokens[after]) / max(sum(passes[after]), 1),
    )


def interactive_beside_batch(
    base: str,
    batch: list[Question],
    interactive: list[Question],
    requests: int,
    max_tokens: int,
    mode: str,
) -> tuple[LoadResult, int]:
    """The interactive clients while the batch runs (started first, and running: a line
    answered); the batch lines answered meanwhile. The batch is cancelled afterwards."""
    with httpx.Client(base_url=base, timeout=600) as client:
        batch_id = start_batch(client, batch, max_tokens, mode)

        def answered() -> int:
            return int(client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"])

        while answered() < 1:
            time.sleep(POLL_SECONDS)
        before = answered()
        result = asyncio.run(
            run_level(base, interactive, INTERACTIVE_CONCURRENCY, mode, requests, max_tokens)
        )
        meanwhile = answered() - before
        client.post(f"/v1/batches/{batch_id}/cancel")
    return result, meanwhile


def compare(
    servers: Callable[[], AbstractContextManager[str]],
    questions: list[Question],
    lines: int,
    interactive_requests: int,
    max_tokens: int,
    mode: str,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Each setting on a server of its own (`servers()` starts one with a batch store)."""
    batch = batch_questions(questions, lines)
    chat = interactive_questions(questions)
    with servers() as base:
        wait_warm(base, True)
        batch_run = run_batch(base, batch, max_tokens, mode)
    progress(f"batch: {_json(batch_run.summary())}")
    with servers() as base:
        wait_warm(base, True)
        client = asyncio.run(run_level(base, batch, CLIENT_CONCURRENCY, mode, lines, max_tokens))
    progress(f"client C={CLIENT_CONCURRENCY}: {_json(client.summary())}")
    with servers() as base:
        wait_warm(base, True)
        alone = asyncio.run(
            run_level(base, chat, INTERACTIVE_CONCURRENCY, mode, interactive_requests, max_tokens)
        )
    progress(f"interactive: {_json(alone.summary())}")
    with servers() as base:
        wait_warm(base, True)
        beside, meanwhile = interactive_beside_batch(
            base, batch, chat, interactive_requests, max_tokens, mode
        )
    progress(f"interactive + batch: {_json(beside.summary())}, batch lines meanwhile {meanwhile}")
    return {
        "batch": batch_run.summary(),
        "client": client.summary(),
        "interactive": alone.summary(),
        "interactive_with_batch": {**beside.summary(), "batch_lines_meanwhile": meanwhile},
    }


def _json(summary: dict[str, Any]) -> str:
    return json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})


def format_tables(report: dict[str, Any]) -> str:
    """The throughput and the interactive latency tables (markdown)."""
    batch, client = report["batch"], report["client"]
    alone, beside = report["interactive"], report["interactive_with_batch"]
    return "\n".join(
        [
            "| setting | lines | seconds | output tok/s | tokens/pass, first "
            f"{WARM_LINES} lines | after |",
            "|---|---|---|---|---|---|",
            f"| batch | {batch['lines']} | {batch['seconds']:.1f} | "
            f"{batch['tokens_per_second']:.1f} | {batch['tokens_per_pass_first']:.2f} | "
            f"{batch['tokens_per_pass_after']:.2f} |",
            f"| client C={CLIENT_CONCURRENCY} | {client['requests']} | "
            f"{client['requests'] / client['requests_per_second']:.1f} | "
            f"{client['output_tokens_per_second']:.1f} | {client['tokens_per_pass']:.2f} | |",
            "",
            f"batch / client throughput: "
            f"{batch['tokens_per_second'] / client['output_tokens_per_second']:.2f}x",
            "",
            "| setting | requests | TTFT p50 ms | ITL p50 ms | batch lines meanwhile |",
            "|---|---|---|---|---|",
            f"| interactive C={INTERACTIVE_CONCURRENCY} | {alone['requests']} | "
            f"{alone['ttft_p50_ms']:.0f} | {alone['itl_p50_ms']:.1f} | |",
            f"| interactive C={INTERACTIVE_CONCURRENCY}, batch running | {beside['requests']} | "
            f"{beside['ttft_p50_ms']:.0f} | {beside['itl_p50_ms']:.1f} | "
            f"{beside['batch_lines_meanwhile']} |",
            "",
            "with the batch / alone: "
            f"TTFT p50 {beside['ttft_p50_ms'] / alone['ttft_p50_ms']:.2f}x, "
            f"ITL p50 {beside['itl_p50_ms'] / max(alone['itl_p50_ms'], 1e-9):.2f}x",
        ]
    )


def run_command(
    servers: Callable[[], AbstractContextManager[str]],
    questions: list[Question],
    lines: int,
    interactive_requests: int,
    max_tokens: int,
    mode: str,
    json_path: Path | None,
) -> None:
    report = compare(servers, questions, lines, interactive_requests, max_tokens, mode)
    print(f"\n{format_tables(report)}", flush=True)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
