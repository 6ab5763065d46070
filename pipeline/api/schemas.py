"""The API's objects with OpenAI's field names. Records add what only the server keeps (the owner)."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jobs.schemas import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
ACTIVE_STATUSES: tuple[str, ...] = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL_STATUSES: tuple[str, ...] = ("failed", "completed", "expired", "cancelled")
FILE_PURPOSES: tuple[str, ...] = ("batch",)  # what may be uploaded; the server writes "batch_output" files

PUBLIC_EXCLUDE = {"owner", "requests"}
MAX_FILENAME_CHARS = 255
DEFAULT_UPLOAD_NAME = "upload.jsonl"


def safe_filename(name: str | None) -> str:
    """A client's file name as stored and shown (and sent back in Content-Disposition): its last path
    component (after either slash), without control characters (NUL included), at most 255 characters;
    upload.jsonl when nothing is left ('', '.', '..')."""
    base = re.split(r"[/\\]", name or "")[-1]
    base = "".join(c for c in base if c.isprintable()).strip()
    return base[:MAX_FILENAME_CHARS] if base not in ("", ".", "..") else DEFAULT_UPLOAD_NAME


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None

    @field_validator("filename")
    @classmethod
    def _safe_filename(cls, v: str) -> str:
        return safe_filename(v)  # also for records stored before names were reduced


class FileRecord(FileObject):
    owner: str
    requests: int = 0  # non-empty lines (batch input files)

    def public(self) -> dict[str, Any]:
        return self.model_dump(exclude=PUBLIC_EXCLUDE)


class BatchErrorItem(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class TokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: TokensDetails = Field(default_factory=TokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage = Field(default_factory=BatchUsage)
    metadata: dict[str, str] | None = None


class BatchRecord(BatchObject):
    owner: str

    def public(self) -> dict[str, Any]:
        return self.model_dump(exclude=PUBLIC_EXCLUDE)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(..., min_length=1, max_length=128)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _openai_metadata_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("metadata holds at most 16 key-value pairs")
        for k, val in v.items():
            if len(k) > 64:
                raise ValueError(f"metadata key {k[:20]!r}... is over 64 characters")
            if len(val) > 512:
                raise ValueError(f"metadata value of {k!r} is over 512 characters")
        return v


ENDPOINTS = (ENDPOINT_CHAT, ENDPOINT_COMPLETIONS)


def list_page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: {"object": "list", "data", "first_id", "last_id", "has_more"}."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}
