"""The Files and Batches APIs' request and response shapes (OpenAI's), for validation and the
published schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from app.batches.lines import Endpoint
from app.batches.store import BatchStatus
from app.schemas import LenientPart

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds


class BatchCreateRequest(LenientPart):
    input_file_id: str
    endpoint: Endpoint = Field(description="the route every line of the file asks for")
    completion_window: Literal["24h"] = Field(
        description="lines without an answer by then end as `batch_expired`"
    )
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_KEYS)

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"keys of at most {MAX_METADATA_KEY} characters, values of at most "
                    f"{MAX_METADATA_VALUE}"
                )
        return metadata


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: str
    status_details: str | None
    expires_at: int | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedFile(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]] = Field(description="`code`, `message`, `line` each")


class BatchStats(BaseModel):
    """The speculation of a batch's answered lines, summed."""

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    draft_acceptance_rate: float
    accepted_by_strategy: dict[str, int]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    speculative_decoding_stats: BatchStats | None = Field(
        None, description="extension: what speculation did over the answered lines"
    )


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
