"""The FastAPI app: routes, OpenAI-shaped errors, authentication before the body, the per-key limit on
requests in flight, the body limit, and a lifespan that opens the Redis connections and resumes the
batches a previous server process left active."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff

from pipeline.api import errors, metrics, routes_batches, routes_completions, routes_files
from pipeline.api.auth import AuthMiddleware, KeyRing
from pipeline.api.batch_runner import BatchSupervisor, RunnerContext
from pipeline.api.batches import BatchStore
from pipeline.api.completions import CompletionService
from pipeline.api.config import MULTIPART_ENVELOPE_BYTES, ServeConfig
from pipeline.api.files import FileStore
from pipeline.api.limits import BodyLimitMiddleware, InFlightLimitMiddleware
from pipeline.api.metrics import metrics_registry
from pipeline.api.state import ApiState
from pipeline.client import Client
from jobs.redis_conn import REDIS_DOWN_ERRORS, RETRY_ATTEMPTS, RETRY_BACKOFF_BASE, RETRY_BACKOFF_CAP, tcp_options

log = logging.getLogger("rqllm.api")


def async_redis(url: str) -> aioredis.Redis:
    """The event loop's connection, retrying like jobs.redis_conn.connect's (a Redis restart is waited out)."""
    retry = AsyncRetry(ExponentialBackoff(cap=RETRY_BACKOFF_CAP, base=RETRY_BACKOFF_BASE), RETRY_ATTEMPTS)
    return aioredis.Redis.from_url(url, retry=retry, retry_on_error=list(REDIS_DOWN_ERRORS),
                                   **tcp_options(url, socket_keepalive=True),  # none for the embedded unix socket
                                   socket_connect_timeout=5, health_check_interval=30)


def create_app(config: ServeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config.make_dirs()
        client = Client(config.redis_url)
        client.ping()
        aredis = async_redis(config.redis_url)
        files, batches = FileStore(client.connection, config), BatchStore(client.connection)
        supervisor = BatchSupervisor(RunnerContext(client, batches, files, config))
        app.state.api = ApiState(config=config, client=client, aredis=aredis, files=files, batches=batches,
                                 supervisor=supervisor, completions=CompletionService(client, aredis, config),
                                 metrics=metrics_registry(client))
        resumed = supervisor.resume_all()
        if resumed:
            log.warning("resumed %d batch(es) left active by an earlier server", resumed)
        try:
            yield
        finally:
            supervisor.stop()
            await aredis.aclose()
            client.connection.close()

    # No /docs or /openapi.json: every endpoint asks for a key, and those would not.
    app = FastAPI(title="rqllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.keyring = KeyRing(config.api_keys, insecure_no_auth=config.insecure_no_auth)
    errors.install(app)
    for module in (routes_files, routes_batches, routes_completions, metrics):
        app.include_router(module.router)

    upload_limit = config.max_file_bytes + MULTIPART_ENVELOPE_BYTES

    def limit_for(method: str, path: str) -> int:
        return upload_limit if method == "POST" and path.rstrip("/") == "/v1/files" else config.max_body_bytes

    # The last added runs first: the key is checked on the headers alone, then the key's requests in
    # flight are counted, then the body is limited as it is read (by the routes, after all three).
    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)
    app.add_middleware(InFlightLimitMiddleware, limit=config.max_requests_in_flight_per_key)
    app.add_middleware(AuthMiddleware, keyring=app.state.keyring)
    return app
