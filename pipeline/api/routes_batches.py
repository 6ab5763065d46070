"""/v1/batches: create, retrieve, cancel, list. The work is done by the batch's runner thread.

Plain `def` handlers: FastAPI runs them in its thread pool (they make blocking Redis calls)."""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from pipeline.api.auth import require_owner
from pipeline.api.errors import APIError
from pipeline.api.limits import too_many
from pipeline.api.schemas import BatchRecord, CreateBatchRequest, RequestCounts, list_page
from pipeline.api.state import api_state

router = APIRouter(prefix="/v1")
_CREATING = threading.Lock()  # a key's limits are checked and its batch recorded as one step


@router.post("/batches")
def create_batch(request: Request, body: CreateBatchRequest,
                       owner: str = Depends(require_owner)) -> dict[str, Any]:
    st = api_state(request)
    source = st.files.get_owned(body.input_file_id, owner, param="input_file_id")
    if source.purpose != "batch":
        raise APIError(400, f"file {source.id} has purpose {source.purpose!r}; a batch needs a file uploaded with "
                            "purpose 'batch'", param="input_file_id", code="invalid_value")
    now = int(time.time())
    record = BatchRecord(
        id="batch_" + uuid.uuid4().hex[:24], endpoint=body.endpoint, input_file_id=source.id,
        completion_window=body.completion_window, status="validating", created_at=now,
        expires_at=now + st.config.completion_window_seconds, metadata=body.metadata, owner=owner,
        request_counts=RequestCounts(total=source.requests),
    )
    with _CREATING:
        active, limits = st.batches.active_totals(owner), st.config
        if len(active) >= limits.max_active_batches_per_key:
            raise too_many(f"this API key has {len(active)} batches not yet ended, the limit is "
                           f"{limits.max_active_batches_per_key}")
        if sum(active) + source.requests > limits.max_active_lines_per_key:
            raise too_many(f"this API key's batches not yet ended hold {sum(active):,} request lines; "
                           f"{source.requests:,} more would pass the limit of {limits.max_active_lines_per_key:,}")
        st.batches.create(record, home=st.config.home_id())
    st.supervisor.start(record.id)
    return record.public()


@router.get("/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str, owner: str = Depends(require_owner)) -> dict[str, Any]:
    return api_state(request).batches.get_owned(batch_id, owner).public()


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str, owner: str = Depends(require_owner)) -> dict[str, Any]:
    st = api_state(request)
    record = st.batches.get_owned(batch_id, owner)
    if st.batches.transition(batch_id, ("validating", "in_progress"), "cancelling"):
        st.supervisor.cancel(batch_id)
    elif record.status not in ("cancelling", "cancelled"):
        current = st.batches.field(batch_id, "status")
        if current not in ("cancelling", "cancelled"):
            raise APIError(409, f"Cannot cancel a batch with status {current!r}.", code="invalid_state")
    return st.batches.get_owned(batch_id, owner).public()


@router.get("/batches")
def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                       owner: str = Depends(require_owner)) -> dict[str, Any]:
    records, more = api_state(request).batches.list(owner, after=after, limit=limit)
    return list_page([r.public() for r in records], more)
