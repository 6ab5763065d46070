"""/v1/chat/completions, /v1/completions (pipeline.api.completions) and /v1/models."""
from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from jobs.schemas import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, model_key
from pipeline.api.auth import require_owner
from pipeline.api.completions import Release
from pipeline.api.errors import APIError
from pipeline.api.state import api_state, read_json

router = APIRouter(prefix="/v1")
CLIENT_CLOSED = 499  # nginx's status for a request whose client left; nobody reads it


async def _complete(request: Request, endpoint: str, owner: str) -> Response:
    service = api_state(request).completions
    job, stream, include_usage = service.parse(await read_json(request), endpoint, owner)
    await service.require_model(job.model)
    request_id = "req-" + uuid.uuid4().hex
    await service.start(job, request_id)
    if stream:
        release = Release(service, job.id, request_id)
        return StreamingResponse(service.sse(job, release, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(release))
    result = None
    try:
        result = await service.wait(job, request.is_disconnected)
    finally:
        with anyio.CancelScope(shield=True):
            await service.release(job.id, request_id, cancel=result is None)
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(service.response(result))


@router.post("/chat/completions")
async def chat_completions(request: Request, owner: str = Depends(require_owner)) -> Response:
    return await _complete(request, ENDPOINT_CHAT, owner)


@router.post("/completions")
async def completions(request: Request, owner: str = Depends(require_owner)) -> Response:
    return await _complete(request, ENDPOINT_COMPLETIONS, owner)


def _models(request: Request) -> dict[str, dict[str, Any]]:
    """OpenAI's model objects, nothing more: worker names, hosts and running job ids are the operators'
    (`rqllm status`), and a job id would name another key's work."""
    by_model: dict[str, dict[str, Any]] = {}
    for w in api_state(request).client.workers():
        if not w.get("model"):
            continue
        key = model_key(w["model"])
        by_model.setdefault(key, {"id": key, "object": "model", "created": int(time.time()), "owned_by": "rqllm"})
    return by_model


@router.get("/models")
def list_models(request: Request, owner: str = Depends(require_owner)) -> dict[str, Any]:
    """The models that live workers hold."""
    return {"object": "list", "data": sorted(_models(request).values(), key=lambda m: m["id"])}


@router.get("/models/{model}")
def retrieve_model(request: Request, model: str, owner: str = Depends(require_owner)) -> dict[str, Any]:
    try:
        found = _models(request).get(model_key(model))
    except ValueError:  # InvalidJob: a name that gives no queue key
        found = None
    if found is None:
        raise APIError(404, f"The model `{model}` does not exist or no live worker holds it", param="model",
                       code="model_not_found")
    return found
