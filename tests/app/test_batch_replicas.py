"""Replicas sharing a PostgreSQL batch store (a real server: tests/helpers/postgres.py).

Two server processes on one store: a cancel asked through the replica that does not work the
batch reaches the one that does (with its lease renewal); one killed with SIGKILL mid-batch
leaves its batch to the other, which claims it once the lease has expired and answers only
the lines without an answer, each line answered once across the output and error files. A
PostgreSQL stopped mid-batch costs the batch routes a clear error, never the server, and the
batch goes on once it is back."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import httpx
import openai
import psycopg

from app.background import serving, serving_process
from app.main import create_app
from app.settings import Settings
from tests.app.test_batch_restart import chat_lines, chat_requests_served, flags, wait_ready
from tests.app.test_batches import jsonl
from tests.helpers.http import MESSAGES, QUIET, slowed, wait_until
from tests.helpers.http import wait_ready as wait_app_ready

LINES = 24
CANCELLED_LINES = 10 * LINES
LEASE_SECONDS = 2
ENDED = ("completed", "failed", "expired", "cancelled")


def start_batch(client: openai.OpenAI, tag: str, count: int = LINES):
    uploaded = client.files.create(
        file=(f"{tag}.jsonl", io.BytesIO(jsonl(chat_lines(count, tag, 16)))), purpose="batch"
    )
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def custom_ids(client: openai.OpenAI, *file_ids: str | None) -> list[str]:
    """The custom_id of every line of the files, in order."""
    return [
        json.loads(row)["custom_id"]
        for file_id in file_ids
        if file_id is not None
        for row in client.files.content(file_id).text.splitlines()
    ]


def test_a_killed_replicas_batch_is_finished_by_the_other_once_its_lease_expires(
    tiny_served, tmp_path, postgres
) -> None:
    model = tmp_path / "model"
    tiny_served.model.save_pretrained(model)
    tiny_served.tokenizer.save_pretrained(model)
    url = postgres.new_database()
    replica = [*flags(model, url, tmp_path / "cache"), "--batch-lease-seconds", str(LEASE_SECONDS)]
    pids: list[int] = []
    with (
        serving_process(replica, started=pids.append) as first,
        serving_process(replica, started=pids.append) as second,
    ):
        bases = [first, second]
        for base in bases:
            wait_ready(base)
        clients = [
            openai.OpenAI(base_url=f"{b}/v1", api_key="unused", max_retries=0) for b in bases
        ]

        def working(before: list[float]) -> int:
            """The replica that has answered lines since `before` (its route counts)."""
            (index,) = [i for i, b in enumerate(bases) if chat_requests_served(b) > before[i]]
            return index

        # a cancel asked through the other replica stops the batch where it runs (a batch long
        # enough that the working replica's next lease renewal, which reads the cancel, comes
        # before its last line even on a fast machine)
        before = [chat_requests_served(b) for b in bases]
        cancelled = start_batch(clients[0], "cancelled", CANCELLED_LINES)
        wait_until(lambda: clients[0].batches.retrieve(cancelled.id).request_counts.completed >= 2)
        other = 1 - working(before)
        clients[other].batches.cancel(cancelled.id)
        wait_until(lambda: clients[0].batches.retrieve(cancelled.id).status in ENDED, 60)
        done = clients[0].batches.retrieve(cancelled.id)
        assert done.status == "cancelled" and done.request_counts.completed < CANCELLED_LINES

        # the replica working a batch dies; the other goes on with it after the lease
        before = [chat_requests_served(b) for b in bases]
        batch = start_batch(clients[0], "killed")
        wait_until(lambda: clients[0].batches.retrieve(batch.id).request_counts.completed >= 4)
        killed = working(before)
        os.kill(pids[killed], signal.SIGKILL)
        with psycopg.connect(url) as db:
            (kept,) = db.execute(
                "SELECT COUNT(*) FROM results WHERE batch_id = %s", (batch.id,)
            ).fetchone()
        assert 4 <= kept < LINES, "the kill came too late to interrupt the batch"
        survivor, client = bases[1 - killed], clients[1 - killed]
        wait_until(lambda: client.batches.retrieve(batch.id).status in ENDED, 120)
        done = client.batches.retrieve(batch.id)
        served_again = chat_requests_served(survivor) - before[1 - killed]
        answered = custom_ids(client, done.output_file_id, done.error_file_id)
    assert done.status == "completed", done
    assert sorted(answered) == sorted(f"killed-{i}" for i in range(LINES))  # each once
    assert done.request_counts.completed + done.request_counts.failed == LINES
    assert served_again == LINES - kept  # the lines answered before the kill were not run again


def test_a_postgres_stopped_mid_batch_is_a_clear_error_and_the_batch_goes_on_after(
    tiny_served, postgres
) -> None:
    url = postgres.new_database()
    settings = Settings(batch_store=url, batch_concurrency=2, batch_lease_seconds=1, **QUIET)
    app = create_app(settings, loader=lambda _: tiny_served)
    with serving(app) as base:
        wait_app_ready(base)
        wait_until(lambda: httpx.get(f"{base}/v1/batches").status_code == 200, 30)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with slowed(app, 0.05):
            batch = start_batch(client, "stopped", 12)
            wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1)
            postgres.stop()
            try:
                reply = httpx.get(f"{base}/v1/batches/{batch.id}")
                chat = httpx.post(
                    f"{base}/v1/chat/completions",
                    json={"messages": MESSAGES, "max_tokens": 4},
                    timeout=30,
                )
                health = httpx.get(f"{base}/health")
            finally:
                postgres.start()
        assert reply.status_code == 500, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("the batch store postgresql://ngrammys@127.0.0.1:")
        assert postgres.password not in message
        assert chat.status_code == 200 and health.status_code == 200
        # the batch's failure could not be written either: once the database is back, the
        # server claims the batch again and answers the lines that have none
        wait_until(lambda: client.batches.retrieve(batch.id).status in ENDED, 60)
        done = client.batches.retrieve(batch.id)
        answered = custom_ids(client, done.output_file_id, done.error_file_id)
    assert done.status == "completed", done
    assert sorted(answered) == sorted(f"stopped-{i}" for i in range(12))


def test_flags_name_the_store_as_given(tmp_path: Path) -> None:
    """A URL is kept as written (a path would fold its //), a directory as its string."""
    url = "postgresql://user:secret@db:5432/batches"
    assert Settings(batch_store=url).batch_store == url
    assert Settings(batch_store=tmp_path).batch_store == str(tmp_path)
