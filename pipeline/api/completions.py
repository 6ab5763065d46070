"""/v1/chat/completions and /v1/completions: one job on the model's high-priority queue, answered when it
ends, or streamed as server-sent events from its token stream (jobs.streams) as it generates.

The job is content-addressed like any other, and its owner (the API key's owner id) is part of the
content: a request the same key already had answered (same model, input and sampling params with a seed
or temperature 0) is served from its stored result, and the key's identical requests in flight share one
job; another key's identical request is another job. A response carries OpenAI's fields and its job id;
the worker, its timings and prefix-cache hits go to this server's log (batch_output.client_body).

Each request registers in the job's waiters set (jobs.keys.api_waiters_key); a client that leaves before
the end cancels the job unless another request or a batch (all of the same key) still waits for it.

A job that is rerun (its worker died) starts its stream again; text already sent cannot be taken back,
so the rerun's text is sent only from where it passes what was sent. The final result is the reference:
a stream ends with whatever of the result's text was not sent yet, so the concatenated deltas equal the
non-streaming text.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import redis.asyncio as aioredis
from rq.job import Job

from jobs import keys
from jobs.schemas import ENDPOINT_CHAT, GenerationJob, InvalidJob, JobResult, model_key, validate_job
from pipeline.api.batch_output import client_body
from pipeline.api.config import ServeConfig
from pipeline.api.errors import APIError
from pipeline.batch_file import request_to_job
from pipeline.openai_format import (chat_logprobs, completion_logprobs, response_body, stream_chunk,
                                    usage_chunk)
from pipeline.cancel import cancel_unwanted_job
from pipeline.client import Client
from jobs.defaults import ACTIVE_STATUSES
from jobs.streams import decode_entries

log = logging.getLogger("rqllm.api.completions")

IDLE_BLOCK_MS = 1000
ENDED_TICKS = 2  # idle ticks (1 s each) a job must look ended without an outcome before it is submitted again
MAX_RESUBMITS = 2
KEEPALIVE_SECONDS = 15.0
MODELS_CACHE_SECONDS = 2.0
# HTTP status of a failed job, by its error code
_FAILURE_STATUS = {"invalid_request": 400, "timeout": 504, "cancelled": 409, "batch_cancelled": 409,
                   "stopped": 409}


@dataclass
class Delta:
    text: str


@dataclass
class Idle:
    pass


@dataclass
class Ended:
    result: JobResult
    rest: str  # result text not sent yet
    diverged: bool  # a rerun produced other text than was already sent


class Release:
    """A request's hold on its job, let go once: by the stream's own end, or (as the response's background
    task) after a client that left before the stream even started. Cancels the job when the request did not
    get its end."""

    def __init__(self, service: CompletionService, job_id: str, request_id: str):
        self.service, self.job_id, self.request_id = service, job_id, request_id
        self.finished = False
        self._done = False

    async def __call__(self) -> None:
        if not self._done:
            self._done = True
            await self.service.release(self.job_id, self.request_id, cancel=not self.finished)


def failure_error(result: JobResult) -> APIError:
    code = result.error.code if result.error else "failed"
    message = result.error.message if result.error else "the request failed"
    status = _FAILURE_STATUS.get(code, 500)
    return APIError(status, f"{code}: {message}", code=code, type=None if status < 500 else "server_error")


def log_outcome(result: JobResult) -> None:
    """What the response does not say (it would describe the worker's other tenants): for operators."""
    log.info("job %s %s on %s (attempt %d): %d prompt tokens, %d from the prefix cache, prefill %.3f s, "
             "decode %.3f s", result.job_id, result.status, result.worker or "-", result.attempt,
             result.prompt_tokens, result.prefix_hit_tokens, result.prefill_seconds, result.decode_seconds)


class CompletionService:
    def __init__(self, client: Client, aredis: aioredis.Redis, config: ServeConfig):
        self.client = client
        self.aredis = aredis
        self.config = config
        self._models: tuple[float, set[str]] = (0.0, set())

    # ------------------------------------------------------------ request -> job
    def parse(self, body: Any, endpoint: str, owner: str) -> tuple[GenerationJob, bool, bool]:
        """(job, stream, include_usage) from a request body of `owner` (the key's owner id, part of the
        job's id); APIError 400 names what is wrong."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        body = dict(body)
        stream = body.pop("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "stream must be true or false", param="stream")
        options = body.pop("stream_options", None)
        if options is not None and not isinstance(options, dict):
            raise APIError(400, "stream_options must be an object", param="stream_options")
        if options is not None and not stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        include_usage = bool((options or {}).get("include_usage", False))
        if endpoint == ENDPOINT_CHAT and "messages" not in body:
            raise APIError(400, "messages is required", param="messages")
        line = {"custom_id": "req-" + uuid.uuid4().hex, "method": "POST", "url": endpoint, "body": body}
        try:
            job = request_to_job(line, default_model=self.config.default_model)
            job = validate_job({**job.model_dump(exclude={"id"}), "owner": owner})  # the id follows the owner
        except InvalidJob as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        return job, stream, include_usage

    async def served_models(self) -> set[str]:
        at, models = self._models
        if time.monotonic() - at > MODELS_CACHE_SECONDS:
            workers = await anyio.to_thread.run_sync(self.client.workers)
            models = {model_key(w["model"]) for w in workers if w.get("model")}
            self._models = (time.monotonic(), models)
        return models

    async def require_model(self, model: str) -> None:
        models = await self.served_models()
        if model_key(model) not in models:
            held = ", ".join(sorted(models)) or "none"
            raise APIError(404, f"The model `{model}` does not exist or no live worker holds it (workers hold: "
                                f"{held})", param="model", code="model_not_found")

    # ------------------------------------------------------------ queue
    def _submit(self, job: GenerationJob) -> None:
        self.client.submit(job, priority="high", timeout=self.config.job_timeout)

    def _start(self, job: GenerationJob, request_id: str) -> None:
        waiters = keys.api_waiters_key(job.id)
        with self.client.connection.pipeline(transaction=False) as p:
            p.sadd(waiters, request_id)
            p.expire(waiters, self.client.options.stream_ttl)
            p.execute()
        self._submit(job)

    async def start(self, job: GenerationJob, request_id: str) -> None:
        await anyio.to_thread.run_sync(self._start, job, request_id)

    async def release(self, job_id: str, request_id: str, *, cancel: bool) -> None:
        """The request is done with the job; `cancel` when its client left before the end."""
        await self.aredis.srem(keys.api_waiters_key(job_id), request_id)
        if cancel:
            await anyio.to_thread.run_sync(lambda: cancel_unwanted_job(
                self.client.connection, job_id, code="cancelled",
                message="the client disconnected before the request finished",
                result_ttl=self.client.options.result_ttl, stream_ttl=self.client.options.stream_ttl))

    # ------------------------------------------------------------ following a job
    async def _result(self, job_id: str) -> JobResult | None:
        raw = await self.aredis.get(keys.result_key(job_id))
        return JobResult.model_validate_json(raw) if raw else None

    async def follow(self, job: GenerationJob) -> AsyncIterator[Delta | Idle | Ended]:
        """Deltas of the job's text as it streams, Idle when nothing came for a while, then Ended."""
        job_id = job.id
        stream_key = keys.token_stream_key(job_id)
        sent = run = ""
        last = "0"
        ended_ticks = resubmits = 0
        result = await self._result(job_id)  # already answered (a cached result): no stream needed
        if result is None:
            tail = decode_entries(await self.aredis.xrevrange(stream_key, count=1))
            if tail and tail[0].type == "end":
                # An earlier run that left no result (it failed, and the claim cleared that for this rerun):
                # skip it; the rerun starts the stream again.
                last = tail[0].id
        while result is None:
            reply = await self.aredis.xread({stream_key: last}, count=500, block=IDLE_BLOCK_MS)
            entries = decode_entries(reply[0][1]) if reply else []
            if not entries:
                result = await self._result(job_id)
                if result is None:
                    ended_ticks = ended_ticks + 1 if await self._ended_without_outcome(job_id) else 0
                    if ended_ticks >= ENDED_TICKS:
                        ended_ticks = 0
                        resubmits += 1
                        await self._recover(job, give_up=resubmits > MAX_RESUBMITS)
                    yield Idle()
                continue
            for e in entries:
                last = e.id
                if e.type == "start":
                    run = ""
                elif e.type == "text":
                    run += str(e.data.get("text", ""))
                    if len(run) > len(sent) and run.startswith(sent):
                        delta, sent = run[len(sent):], run
                        yield Delta(delta)
                elif e.type == "end":
                    result = await self._result(job_id)
                    if result is not None:
                        break
                    run = ""  # a run whose outcome was cleared by a resubmission: its rerun follows
        diverged = not result.text.startswith(sent)
        yield Ended(result, "" if diverged else result.text[len(sent):], diverged)

    async def _ended_without_outcome(self, job_id: str) -> bool:
        status = await self.aredis.hget(Job.key_for(job_id), "status")
        return status is None or status.decode() not in ACTIVE_STATUSES

    async def _recover(self, job: GenerationJob, *, give_up: bool) -> None:
        """rq no longer runs the job and it has no outcome. Usually an identical request cleared the failed
        outcome of a run that rq was still wrapping up, and joined that run instead of starting a new one:
        submit it again. After MAX_RESUBMITS, record the failure (the job was deleted or canceled elsewhere)."""
        if give_up:
            await anyio.to_thread.run_sync(lambda: self.client.reconcile("", [job.id], grace=1.0))
        else:
            await anyio.to_thread.run_sync(self._submit, job)

    async def wait(self, job: GenerationJob, disconnected: Any) -> JobResult | None:
        """The job's result; None when `disconnected()` says the client left first."""
        checked = 0.0
        async for event in self.follow(job):
            if isinstance(event, Ended):
                return event.result
            if time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await disconnected():
                    return None
        raise AssertionError("follow() ends with Ended")

    # ------------------------------------------------------------ responses
    def response(self, result: JobResult) -> dict[str, Any]:
        log_outcome(result)
        if result.status != "done":
            raise failure_error(result)
        return client_body(response_body(result))

    async def sse(self, job: GenerationJob, release: Release, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: chunks as OpenAI sends them, the usage (only with stream_options.include_usage,
        in a last chunk with no choices), then `data: [DONE]`."""
        chat = job.endpoint == ENDPOINT_CHAT
        created = int(time.time())

        def chunk(content: str | None, *, role: bool = False, finish: str | None = None,
                  logprobs: dict[str, Any] | None = None) -> str:
            obj = stream_chunk(job.id, job.model, created, chat, content, role=role, finish=finish,
                               logprobs=logprobs, include_usage=include_usage)
            return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

        try:
            if chat:
                yield chunk("", role=True)
            quiet_since = time.monotonic()
            async for event in self.follow(job):
                if isinstance(event, Delta):
                    quiet_since = time.monotonic()
                    yield chunk(event.text)
                elif isinstance(event, Idle):
                    if time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
                        quiet_since = time.monotonic()
                        yield ": keep-alive\n\n"  # comment line: keeps proxies from timing out a queued request
                else:
                    result = event.result
                    release.finished = True
                    log_outcome(result)
                    if result.status != "done":
                        yield "data: " + json.dumps(failure_error(result).body(), ensure_ascii=False) + "\n\n"
                    elif event.diverged:
                        err = APIError(500, "the job was rerun after a worker was lost and produced other text "
                                            "than was already streamed", code="stream_diverged")
                        yield "data: " + json.dumps(err.body()) + "\n\n"
                    else:
                        if event.rest:
                            yield chunk(event.rest)
                        # The stream carries text only: the tokens' logprobs all come with the finishing chunk
                        logprobs = chat_logprobs(result) if chat else completion_logprobs(result)
                        yield chunk(None if chat else "", finish=result.finish_reason, logprobs=logprobs)
                        if include_usage:  # once, as OpenAI sends it: a last chunk with no choices
                            last = usage_chunk(job.id, job.model, created, chat, result)
                            yield "data: " + json.dumps(last) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            with anyio.CancelScope(shield=True):  # runs also when the client left and the task is cancelled
                await release()
