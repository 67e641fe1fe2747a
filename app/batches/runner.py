"""Runs the store's unfinished batches, oldest first, each line through the server's own route.

A line is sent in process (httpx's ASGI transport, no socket) to the route its `url` names, with
the batch priority header, so it gets exactly what the same body gets from a client, and the
engine runs it in the capacity interactive requests leave (`service/engine/scheduler.py`). Up
to `--batch-concurrency` lines of a batch are in flight at once. A line answered 429 or 503 (the
server busy, or still loading) is sent again after the Retry-After; any other answer is the
line's: 200 goes to the output file, the rest to the error file. Each answer is committed to the
store before the next step counts it, so after a restart the runner sends only the lines that
have no answer yet.

Leases: before working a batch the runner claims it in the store (`hold`), and renews the claim
every third of `--batch-lease-seconds` while it works, reading with each renewal whether a
cancel was asked for (through any replica). A renewal that fails, or finds the batch held by
another replica, stops the work; the batch's writes are made under the lease, so a runner that
lost it writes nothing more of it. Replicas sharing a PostgreSQL store thus work different
batches at once, and a batch whose replica died is taken over once its lease has expired, with
the lines that have no answer; a store one server owns (SQLite) grants every claim.

States (OpenAI's): `validating` (the file read again, each line's url checked against the
batch's endpoint) → `in_progress` → `finalizing` (the output and error files written, lines in
the input's order) → `completed`; `failed` (validation, or the store), `cancelling` →
`cancelled` (the lines in flight aborted; those answered kept), `expired` (past the completion
window: the lines without an answer are in the error file as `batch_expired`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

from app.batches.lines import BatchLine, parse_lines
from app.batches.store import (
    UNFINISHED,
    BatchRecord,
    BatchStatus,
    BatchStore,
    LeaseLost,
    StoreError,
)
from app.errors import ApiError
from app.serving import PRIORITY_HEADER

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRIED_STATUSES = (429, 503)  # not the line's answer: the server's state; sent again
IDLE_POLL_SECONDS = 1.0  # how often an idle runner looks at the store (a new batch wakes it)
# the per-line speculation counts a batch sums over its answered lines
SUMMED_STATS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")


class BatchRunner:
    """The one task that works through the batches (`run`), woken by new work (`wake`)."""

    def __init__(
        self,
        app: FastAPI,
        store: BatchStore,
        concurrency: int,
        key: str | None,
        lease_seconds: float,
    ) -> None:
        self.app, self.store, self.concurrency = app, store, concurrency
        self.lease_seconds = lease_seconds
        # this server as its leases name it: where to look when a batch seems stuck
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        headers = {PRIORITY_HEADER: "batch"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://batch",
            headers=headers,
            timeout=None,
        )
        self._wake = asyncio.Event()
        self._cancel: set[str] = set()  # batches asked to stop while they run
        self._lost: set[str] = set()  # batches whose lease this server no longer holds
        self._current: str | None = None  # the batch this server works now
        self.lines_answered = {"completed": 0, "failed": 0}  # since start (metrics)
        self.tokens = 0  # completion tokens of answered lines since start (metrics)

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stop the batch's lines in flight if this server works it (its cancel is asked for
        in the store already: the replica that works it reads it with its lease)."""
        if batch_id == self._current:
            self._cancel.add(batch_id)
            self._wake.set()

    async def run(self) -> None:
        """Forever: each unfinished batch to its end, then wait for more."""
        try:
            while True:
                self._wake.clear()
                if self.app.state.runtime is not None and not self.app.state.draining:
                    try:
                        batches = await self._call(self.store.unfinished_batches)
                    except StoreError as error:  # tried again at the next look
                        log.error("batch jobs: %s", error)
                        batches = []
                    for batch in batches:
                        if self.app.state.draining:
                            break
                        await self._work(batch.id)
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_SECONDS)
                except TimeoutError:
                    pass
        finally:
            await self._client.aclose()

    async def _work(self, batch_id: str) -> None:
        """The batch as far as it goes now, if this server can claim it: under its lease,
        renewed meanwhile, and given up afterwards (for another replica to take at once)."""
        try:
            lease = await self._call(self.store.hold, batch_id, self.owner, self.lease_seconds)
            if lease is None:
                return  # another replica works it
            self._lost.discard(batch_id)
            batch = await self._call(self.store.get_batch, batch_id)
        except StoreError as error:  # tried again at the next look
            log.error("batch %s: %s", batch_id, error)
            return
        try:
            if batch is None or batch.status not in UNFINISHED:
                return  # ended by another replica since the list was read
            if lease.cancel_asked:
                self._cancel.add(batch_id)
            renewal = asyncio.create_task(self._renew(batch_id))
            self._current = batch_id
            try:
                await self._advance(batch)
            finally:
                self._current = None
                renewal.cancel()
                await asyncio.gather(renewal, return_exceptions=True)
        finally:
            try:
                await self._call(self.store.release, batch_id, self.owner)
            except StoreError as error:  # the lease expires by itself
                log.error("batch %s: its lease cannot be given up: %s", batch_id, error)

    async def _renew(self, batch_id: str) -> None:
        """Every third of the lease: renew it, and take up a cancel asked for through any
        replica; once it cannot be renewed, mark the batch lost (its work stops)."""
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                lease = await self._call(
                    self.store.hold, batch_id, self.owner, self.lease_seconds, True
                )
            except StoreError as error:
                log.error("batch %s: its lease cannot be renewed, work stops: %s", batch_id, error)
                lease = None
            else:
                if lease is None:
                    log.warning("batch %s: another server holds its lease, work stops", batch_id)
            if lease is None:
                self._lost.add(batch_id)
                self._wake.set()
                return
            if lease.cancel_asked and batch_id not in self._cancel:
                self._cancel.add(batch_id)
                self._wake.set()

    async def _advance(self, batch: BatchRecord) -> None:
        """`batch` as far as it goes now: to its end, or to the server's draining."""
        try:
            lines: list[BatchLine] = []
            if batch.cancel_asked_at is not None:
                self._cancel.add(batch.id)
            if batch.status in ("validating", "in_progress") and batch.id not in self._cancel:
                lines = await self._validated(batch)
            if batch.status == "in_progress" and batch.id not in self._cancel:
                await self._run_lines(batch, lines)
            if batch.status == "finalizing" or (
                batch.status in ("validating", "in_progress") and batch.id in self._cancel
            ):
                await self._finalize(batch)
        except LeaseLost:  # another replica works it now
            log.warning("batch %s: its lease was lost; another server goes on with it", batch.id)
        except Exception as error:  # a store that fails, or a bug: this batch fails, not the runner
            log.exception("batch %s failed", batch.id)
            code = "batch_store_error" if isinstance(error, StoreError) else "batch_runner_error"
            batch.errors = [{"code": code, "message": str(error), "line": None}]
            try:
                await self._set_status(batch, "failed")
            except (StoreError, LeaseLost):
                log.exception("batch %s: the store cannot record its failure", batch.id)

    async def _validated(self, batch: BatchRecord) -> list[BatchLine]:
        """The batch's lines, read again from its input file; a batch whose file is gone or
        whose lines ask for another endpoint fails here, with the lines named."""
        try:
            content = await self._call(self.store.read_content, batch.input_file_id)
            lines = await self._call(parse_lines, content, self.app.state.model_name)
        except (StoreError, ApiError) as error:
            message = error.message if isinstance(error, ApiError) else str(error)
            batch.errors = [{"code": "invalid_file", "message": message, "line": None}]
            await self._set_status(batch, "failed")
            return []
        wrong = [i for i, line in enumerate(lines, start=1) if line.url != batch.endpoint]
        if wrong:
            batch.errors = [
                {
                    "code": "mismatched_endpoint",
                    "message": f"the line's url is not the batch's endpoint {batch.endpoint}",
                    "line": i,
                }
                for i in wrong[:100]
            ]
            await self._set_status(batch, "failed")
        elif batch.status == "validating":
            await self._set_status(batch, "in_progress")
        return lines

    async def _run_lines(self, batch: BatchRecord, lines: list[BatchLine]) -> None:
        """Answer every line without an answer, `concurrency` at a time, until all are
        answered (→ finalizing), the batch is cancelled or expires, or the server drains."""
        answered = await self._call(self.store.answered_lines, batch.id)
        todo = iter([i for i in range(len(lines)) if i not in answered])
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while True:
                if batch.id in self._lost:
                    raise LeaseLost(f"batch {batch.id}: its lease is lost")
                if batch.id in self._cancel or self.app.state.draining:
                    break
                if time.time() >= batch.expires_at:
                    await self._expire(batch, lines)
                    return
                while len(in_flight) < self.concurrency and (i := next(todo, None)) is not None:
                    in_flight.add(asyncio.create_task(self._answer(batch, i, lines[i])))
                if not in_flight:
                    if batch.id not in self._cancel:
                        await self._set_status(batch, "finalizing")
                    return
                woken = asyncio.create_task(self._wake.wait())
                done, _ = await asyncio.wait(
                    {*in_flight, woken},
                    timeout=max(batch.expires_at - time.time(), 0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                woken.cancel()
                self._wake.clear()
                for task in done - {woken}:
                    in_flight.discard(task)
                    task.result()  # a StoreError fails the batch
        finally:
            for task in in_flight:
                task.cancel()  # the route aborts its engine request
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _answer(self, batch: BatchRecord, index: int, line: BatchLine) -> None:
        """Send one line until the server answers it, and keep the answer."""
        while True:
            reply = await self._client.post(line.url, json=line.body)
            if reply.status_code not in RETRIED_STATUSES:
                break
            if self.app.state.draining or batch.id in self._lost:
                return  # answered after the restart, or by the replica that holds the lease
            await asyncio.sleep(float(reply.headers.get("retry-after") or 1) or 1)
        try:
            body: Any = reply.json()
        except ValueError:
            body = reply.text
        ok = reply.status_code == 200
        record = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": line.custom_id,
            "response": {
                "status_code": reply.status_code,
                "request_id": body.get("id", "") if isinstance(body, dict) else "",
                "body": body,
            },
            "error": None,
        }
        if await self._call(self.store.record_line, batch.id, index, ok, record):
            self.lines_answered["completed" if ok else "failed"] += 1
            if ok and isinstance(body, dict):
                usage = body.get("usage") or {}
                self.tokens += usage.get("completion_tokens") or usage.get("output_tokens") or 0

    async def _expire(self, batch: BatchRecord, lines: list[BatchLine]) -> None:
        """Past the completion window: every line without an answer is `batch_expired`."""
        answered = await self._call(self.store.answered_lines, batch.id)
        for index, line in enumerate(lines):
            if index not in answered:
                error = {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the completion "
                    "window expired.",
                }
                record = {
                    "id": f"batch_req_{uuid.uuid4().hex}",
                    "custom_id": line.custom_id,
                    "response": None,
                    "error": error,
                }
                await self._call(self.store.record_line, batch.id, index, False, record)
        await self._finalize(batch, ended="expired")

    async def _finalize(self, batch: BatchRecord, ended: BatchStatus | None = None) -> None:
        """Write the output and error files (each once: a file made before a restart is kept)
        and end the batch: `completed`, or `cancelled` if a cancel was asked for, or `ended`."""
        results = await self._call(self.store.results, batch.id)
        for ok, attribute, purpose in (
            (True, "output_file_id", "output"),
            (False, "error_file_id", "error"),
        ):
            records = [record for good, record in results if good is ok]
            if records and getattr(batch, attribute) is None:
                content = ("\n".join(records) + "\n").encode()
                name = f"{batch.id}_{purpose}.jsonl"
                made = await self._call(
                    self.store.add_file, name, "batch_output", content, len(records)
                )
                setattr(batch, attribute, made.id)
                try:
                    await self._call(self.store.save_batch, batch, self.owner)
                except LeaseLost:  # the replica that holds the batch now writes its own
                    await self._call(self.store.delete_file, made.id)
                    raise
        batch.speculation = _summed_stats(record for ok, record in results if ok)
        final: BatchStatus = ended or ("cancelled" if batch.id in self._cancel else "completed")
        await self._set_status(batch, final)
        self._cancel.discard(batch.id)

    async def _set_status(self, batch: BatchRecord, status: BatchStatus) -> None:
        batch.status = status
        batch.times[f"{status}_at"] = int(time.time())
        await self._call(self.store.save_batch, batch, self.owner)

    async def _call(self, work: Callable[..., T], *args: Any) -> T:
        """A store call, off the event loop."""
        return await asyncio.to_thread(work, *args)


def _summed_stats(records: Any) -> dict[str, Any]:
    """The answered lines' speculation counts, summed, with the acceptance they make."""
    totals = dict.fromkeys(SUMMED_STATS, 0)
    by_strategy: dict[str, int] = {}
    for record in records:
        body = json.loads(record)["response"]["body"]
        choices = body.get("choices") or [body]
        for stats in (c.get("speculative_decoding_stats") for c in choices):
            if not stats:
                continue
            for name in SUMMED_STATS:
                totals[name] += stats.get(name, 0)
            for strategy, count in (stats.get("accepted_by_strategy") or {}).items():
                by_strategy[strategy] = by_strategy.get(strategy, 0) + count
    if not totals["num_spec_steps"]:
        return {}
    accepted, drafted = totals["num_accepted_draft_tokens"], totals["num_draft_tokens"]
    return {
        **totals,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "accepted_by_strategy": by_strategy,
    }
