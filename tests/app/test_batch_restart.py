"""A batch survives its server: killed with SIGKILL mid-batch and started again on the same
store, the server finishes the batch; every line is answered exactly once, in the input's
order, and only the lines without a stored answer are run again (counted by the second
server's route metrics)."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
from pathlib import Path

import httpx
import openai

from app.background import serving_process
from tests.helpers.http import MESSAGES, wait_until

LINES = 40


def flags(model: Path, store: Path | str, cache: Path) -> list[str]:
    """A server of the tiny model with a batch store (a directory, or a PostgreSQL URL)."""
    return [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--cache-dir",
        str(cache),
        "--batch-store",
        str(store),
        "--batch-concurrency",
        "2",
        "--default-temperature",
        "0",
        "--no-model-tables",
        "--no-cost-profile",
    ]


def wait_ready(base: str) -> None:
    wait_until(lambda: httpx.get(f"{base}/ready", timeout=5).status_code == 200, timeout=180)


def chat_requests_served(base: str) -> float:
    """The chat route's answers this server gave, from its metrics."""
    total = 0.0
    for row in httpx.get(f"{base}/metrics").text.splitlines():
        if (
            row.startswith("ngrammys_http_requests_total{")
            and 'route="/v1/chat/completions"' in row
        ):
            total += float(row.rsplit(" ", 1)[1])
    return total


def chat_lines(count: int, tag: str, max_tokens: int) -> list[dict]:
    """`count` batch lines of chat requests, `tag-0`, ..., of `max_tokens` and up to 7 more."""
    return [
        {
            "custom_id": f"{tag}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": MESSAGES, "max_tokens": max_tokens + i % 8, "seed": i},
        }
        for i in range(count)
    ]


def test_a_batch_killed_mid_way_finishes_after_a_restart_answering_each_line_once(
    tiny_served, tmp_path
) -> None:
    model = tmp_path / "model"
    tiny_served.model.save_pretrained(model)
    tiny_served.tokenizer.save_pretrained(model)
    store = tmp_path / "store"
    lines = chat_lines(LINES, "line", 24)
    pids: list[int] = []
    with serving_process(flags(model, store, tmp_path / "cache"), started=pids.append) as base:
        wait_ready(base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        content = "\n".join(json.dumps(line) for line in lines).encode()
        uploaded = client.files.create(file=("lines.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4)
        os.kill(pids[0], signal.SIGKILL)
    with sqlite3.connect(store / "store.sqlite3") as db:
        (kept,) = db.execute("SELECT COUNT(*) FROM results").fetchone()
    assert 4 <= kept < LINES, "the kill came too late to interrupt the batch"
    with serving_process(flags(model, store, tmp_path / "cache")) as base:
        wait_ready(base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", timeout=300)
        done = client.batches.retrieve(batch.id)
        served_again = chat_requests_served(base)
        output = client.files.content(done.output_file_id).text.splitlines()
    answered = [json.loads(row)["custom_id"] for row in output]
    assert answered == [line["custom_id"] for line in lines]  # each once, in order
    assert done.request_counts.completed == LINES and done.error_file_id is None
    assert served_again == LINES - kept  # the lines answered before the kill were not run again
