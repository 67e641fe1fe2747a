"""OpenAI's Files and Batches APIs: upload a JSONL file of requests, run it as a batch at idle
priority, poll it, download its output and error files (app/batches/). Off unless the server
has a store (`--batch-store`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from app.auth import client_identity
from app.batches.lines import parse_lines
from app.batches.runner import BatchRunner
from app.batches.schemas import (
    BatchCreateRequest,
    BatchList,
    BatchObject,
    DeletedFile,
    FileList,
    FileObject,
)
from app.batches.store import ENDED, BatchRecord, BatchStore, StoreError, new_id
from app.errors import ApiError
from app.schemas import error_responses

router = APIRouter(
    prefix="/v1", dependencies=[Depends(client_identity)], responses=error_responses(401, 404)
)
T = TypeVar("T")
WINDOW_SECONDS = {"24h": 24 * 3600}


def _store(request: Request) -> BatchStore:
    """The server's batch store; 404 when batch jobs are off, 503 while its store is not open
    (the reason given: held by another server, unreadable; it is tried again)."""
    state = request.app.state
    if state.settings.batch_store is None:
        raise ApiError(
            404,
            "batch jobs are off on this server: it is started without --batch-store",
            code="batches_off",
        )
    store: BatchStore | None = state.batch_store
    if store is None:
        problem = state.batch_store_error or "the batch store is opening"
        raise ApiError(503, problem, "service_unavailable", code="batch_store_unavailable")
    return store


StoreDep = Annotated[BatchStore, Depends(_store)]


async def _stored(work: Callable[..., T], *args: Any) -> T:
    """A store call off the event loop; its failure a 500 that says what failed."""
    try:
        return await asyncio.to_thread(work, *args)
    except StoreError as error:
        raise ApiError(500, str(error), "server_error", code="batch_store_error") from error


def _page(
    items: Sequence[Any], after: str | None, limit: int, param: str = "after"
) -> dict[str, Any]:
    """A list object of the `limit` items after the one whose id is `after`."""
    ids = [item.id for item in items]
    start = 0
    if after is not None:
        if after not in ids:
            raise ApiError(400, f"{param}: no item with id {after!r}", param=param)
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": [item.as_dict() for item in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": start + limit < len(items),
    }


# --- files ------------------------------------------------------------------------------


@router.post("/files", response_model=FileObject, responses=error_responses(400, 413, 500, 503))
async def upload_file(
    request: Request,
    store: StoreDep,
    file: Annotated[UploadFile, File(description="JSONL, one request a line")],
    purpose: Annotated[Literal["batch"], Form()],
) -> dict[str, Any]:
    """A batch input file, each line checked as its route checks it (400 naming the line)."""
    settings = request.app.state.settings
    if await _stored(store.count_files) >= settings.batch_max_files:
        raise ApiError(
            400,
            f"the store holds {settings.batch_max_files} files, its most (--batch-max-files); "
            "delete some first",
            param="file",
            code="too_many_files",
        )
    content = await file.read()
    lines = await asyncio.to_thread(parse_lines, content, request.app.state.model_name)
    name = file.filename or "batch.jsonl"
    record = await _stored(store.add_file, name, purpose, content, len(lines))
    return record.as_dict()


@router.get("/files", response_model=FileList, responses=error_responses(400, 500, 503))
async def list_files(
    store: StoreDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    files = await _stored(store.list_files, purpose)
    return _page(files if order == "asc" else files[::-1], after, limit)


async def _file(store: BatchStore, file_id: str) -> Any:
    record = await _stored(store.get_file, file_id)
    if record is None:
        raise ApiError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
    return record


@router.get("/files/{file_id}", response_model=FileObject, responses=error_responses(500, 503))
async def get_file(file_id: str, store: StoreDep) -> dict[str, Any]:
    return (await _file(store, file_id)).as_dict()


@router.get(
    "/files/{file_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"},
        **error_responses(500, 503),
    },
)
async def file_content(file_id: str, store: StoreDep) -> Response:
    await _file(store, file_id)
    return Response(await _stored(store.read_content, file_id), media_type="application/jsonl")


@router.delete(
    "/files/{file_id}", response_model=DeletedFile, responses=error_responses(400, 500, 503)
)
async def delete_file(file_id: str, store: StoreDep) -> dict[str, Any]:
    await _file(store, file_id)
    running = [b.id for b in await _stored(store.unfinished_batches) if b.input_file_id == file_id]
    if running:
        raise ApiError(
            400, f"the file is the input of batch {running[0]}, still running", param="file_id"
        )
    await _stored(store.delete_file, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


# --- batches ----------------------------------------------------------------------------


@router.post("/batches", response_model=BatchObject, responses=error_responses(400, 500, 503))
async def create_batch(
    body: BatchCreateRequest, request: Request, store: StoreDep
) -> dict[str, Any]:
    """A batch of the file's lines; it runs at once, at idle priority."""
    file = await _stored(store.get_file, body.input_file_id)
    if file is None or file.purpose != "batch":
        raise ApiError(
            400,
            f"input_file_id: no batch input file with id {body.input_file_id!r}",
            param="input_file_id",
        )
    now = int(time.time())
    batch = BatchRecord(
        id=new_id("batch_"),
        endpoint=body.endpoint,
        input_file_id=file.id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + WINDOW_SECONDS[body.completion_window],
        total=file.lines,
        metadata=body.metadata,
    )
    await _stored(store.add_batch, batch)
    _runner(request).wake()
    return batch.as_dict()


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner = request.app.state.batch_runner
    return runner


async def _batch(store: BatchStore, batch_id: str) -> BatchRecord:
    batch = await _stored(store.get_batch, batch_id)
    if batch is None:
        raise ApiError(
            404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found"
        )
    return batch


@router.get("/batches/{batch_id}", response_model=BatchObject, responses=error_responses(500, 503))
async def get_batch(batch_id: str, store: StoreDep) -> dict[str, Any]:
    return (await _batch(store, batch_id)).as_dict()


@router.get("/batches", response_model=BatchList, responses=error_responses(400, 500, 503))
async def list_batches(
    store: StoreDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    """The batches, newest first."""
    return _page(await _stored(store.list_batches), after, limit)


@router.post(
    "/batches/{batch_id}/cancel",
    response_model=BatchObject,
    responses=error_responses(400, 500, 503),
)
async def cancel_batch(batch_id: str, request: Request, store: StoreDep) -> dict[str, Any]:
    """Stop a batch: its lines in flight are aborted, those answered are kept in its files;
    it is `cancelling` until the runner has written them, then `cancelled`."""
    batch = await _batch(store, batch_id)
    if batch.status in ENDED:
        raise ApiError(
            400, f"the batch has ended ({batch.status}); it cannot be cancelled", param="batch_id"
        )
    await _stored(store.ask_cancel, batch_id)
    _runner(request).cancel(batch_id)
    return (await _batch(store, batch_id)).as_dict()
