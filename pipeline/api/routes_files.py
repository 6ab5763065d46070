"""/v1/files: upload (multipart, purpose=batch), list, retrieve, content, delete.

Plain `def` handlers: FastAPI runs them in its thread pool (they make blocking Redis and disk calls)."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from pipeline.api.auth import require_owner
from pipeline.api.errors import APIError, not_found
from pipeline.api.schemas import FILE_PURPOSES, list_page, safe_filename
from pipeline.api.state import api_state

router = APIRouter(prefix="/v1")


@router.post("/files")
def upload_file(request: Request, file: UploadFile = File(...), purpose: str = Form(...),
                      owner: str = Depends(require_owner)) -> dict[str, Any]:
    if purpose not in FILE_PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}, not {purpose!r}", param="purpose",
                       code="invalid_value")
    files = api_state(request).files
    record = files.save_upload(file.file, filename=safe_filename(file.filename), purpose=purpose, owner=owner)
    return record.public()


@router.get("/files")
def list_files(request: Request, purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", after: str | None = None,
                     owner: str = Depends(require_owner)) -> dict[str, Any]:
    records, more = api_state(request).files.list(owner, purpose=purpose, after=after, limit=limit,
                                                  newest_first=order == "desc")
    return list_page([r.public() for r in records], more)


@router.get("/files/{file_id}")
def retrieve_file(request: Request, file_id: str, owner: str = Depends(require_owner)) -> dict[str, Any]:
    return api_state(request).files.get_owned(file_id, owner).public()


@router.get("/files/{file_id}/content")
def file_content(request: Request, file_id: str, owner: str = Depends(require_owner)) -> FileResponse:
    files = api_state(request).files
    record = files.get_owned(file_id, owner)
    path = files.path(record.id)
    if not path.exists():
        raise not_found("file content", file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=record.filename)


@router.delete("/files/{file_id}")
def delete_file(request: Request, file_id: str, owner: str = Depends(require_owner)) -> dict[str, Any]:
    files = api_state(request).files
    record = files.get_owned(file_id, owner)
    files.delete(record)
    return {"id": record.id, "object": "file", "deleted": True}
