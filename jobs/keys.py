"""Redis key names used by rqllm (besides rq's own rq:* keys). Every value stored under them is JSON.

Every rqllm key is built here. Lua scripts get their keys as KEYS; where a script finds the ids only
inside Redis (the batches waiting for a job, the job a dequeue pops), it gets the prefix from here
as an argument and appends the id.
"""
from __future__ import annotations

import json
from typing import Any

PREFIX = "rqllm"


def dumps(obj: Any) -> str:
    """A value as stored under our keys: compact JSON, text kept as it is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


QUEUE_NAME_PREFIX = f"{PREFIX}:"  # rq queues of ours: rqllm:<model key>:<priority> (rq key rq:queue:<name>)


def queue_name(model_key: str, priority: str) -> str:
    """The rq queue of a model (its key, jobs.schemas.model_key) and a priority."""
    return f"{QUEUE_NAME_PREFIX}{model_key}:{priority}"


BATCHES_INDEX = f"{PREFIX}:batches"  # zset: batch id -> created time


def result_key(job_id: str) -> str:
    """String: the JobResult JSON of a job's last outcome (done or failed)."""
    return f"{PREFIX}:result:{job_id}"


def job_batches_key(job_id: str) -> str:
    """Set: ids of the batches waiting for this job (announced to and cleared when it ends)."""
    return f"{PREFIX}:waiting:{job_id}"


def token_stream_key(job_id: str) -> str:
    """Stream: the job's text chunks while it generates, framed by start and end markers."""
    return f"{PREFIX}:tokens:{job_id}"


BATCH_KEY_PREFIX = f"{PREFIX}:batch:"
BATCH_EVENTS_SUFFIX = ":events"


def batch_key(batch_id: str) -> str:
    """Hash: batch metadata and counters (values JSON; counters plain integers, also JSON)."""
    return BATCH_KEY_PREFIX + batch_id


def batch_entries_key(batch_id: str) -> str:
    """List: one JSON [custom_id, job_id] per request line, in submission order."""
    return f"{PREFIX}:batch:{batch_id}:entries"


def batch_refused_key(batch_id: str) -> str:
    """List: one JSON object per input line refused at submission ({custom_id, code, message, line, param,
    file}), in input order: the batch's results hold an error line for each (pipeline.collector)."""
    return f"{PREFIX}:batch:{batch_id}:refused"


def batch_events_key(batch_id: str) -> str:
    """Stream: one entry per job of the batch when it ends (collectors follow it)."""
    return batch_key(batch_id) + BATCH_EVENTS_SUFFIX


def model_header_key(model_key: str) -> str:
    """Hash: sha (of the header) and gguf (base64 of its zlib-compressed bytes), both JSON strings: the
    model's GGUF header and metadata without tensors, as its workers publish it (pipeline.model_header)."""
    return f"{PREFIX}:model_header:{model_key}"


def doorbell_key(model_key: str) -> str:
    """List: wake-up tokens for idle workers of a model (a hint only; losing one loses nothing)."""
    return f"{PREFIX}:wake:{model_key}"


POPPED_KEY_PREFIX = f"{PREFIX}:popped:"


def popped_key(job_id: str) -> str:
    """String (short TTL): the worker that popped this job id and has not registered it as started yet;
    an id left in an intermediate list without one is put back (pipeline.recovery)."""
    return POPPED_KEY_PREFIX + job_id


# ---------------------------------------------------------------- the OpenAI-compatible API (rqllm serve)
# API batch ids are rqllm batch ids (one id, so `rqllm status` and `rqllm collect` see API batches).

API_PREFIX = f"{PREFIX}:api"

API_ACTIVE_BATCHES = f"{API_PREFIX}:batches:active"  # set: API batches not yet ended (a restarted server resumes them)


def api_file_key(file_id: str) -> str:
    """Hash: an uploaded or produced file's metadata (its bytes live on disk under the server's data dir)."""
    return f"{API_PREFIX}:file:{file_id}"


def api_files_index_key(owner: str) -> str:
    """Zset: file id -> created time, per owner (the hash of the API key that made the file)."""
    return f"{API_PREFIX}:files:{owner}"


def api_batch_key(batch_id: str) -> str:
    """Hash: an API batch object's fields and counters."""
    return f"{API_PREFIX}:batch:{batch_id}"


def api_batches_index_key(owner: str) -> str:
    """Zset: batch id -> created time, per owner."""
    return f"{API_PREFIX}:batches:{owner}"


def api_waiters_key(job_id: str) -> str:
    """Set: ids of the HTTP requests waiting for a job (/v1/chat/completions, /v1/completions); a request
    whose client leaves cancels the job only when no other request and no batch still waits for it."""
    return f"{API_PREFIX}:waiters:{job_id}"
