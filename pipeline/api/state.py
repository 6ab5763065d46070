"""What every endpoint reaches through the app: stores, queue client, batch runners (app.state.api)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request

from pipeline.api.batch_runner import BatchSupervisor
from pipeline.api.batches import BatchStore
from pipeline.api.completions import CompletionService
from pipeline.api.config import ServeConfig
from pipeline.api.errors import APIError
from pipeline.api.files import FileStore
from pipeline.client import Client


@dataclass
class ApiState:
    config: ServeConfig
    client: Client
    aredis: aioredis.Redis
    files: FileStore
    batches: BatchStore
    supervisor: BatchSupervisor
    completions: CompletionService
    metrics: Any = None  # GET /metrics's prometheus_client registry (pipeline.api.metrics)


def api_state(request: Request) -> ApiState:
    return request.app.state.api


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
