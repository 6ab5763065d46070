"""A model's tokenizer and chat template, apart from its weights, shared through Redis by the workers.

A producer that only plans (`rqllm summarize` with REDIS_URL) counts prompt tokens exactly as the workers
will, so it needs the model's tokenizer and chat template, but not gigabytes of weights. Each worker, once
its model is loaded, publishes the GGUF's header and metadata without the tensors
(engine.gguf_file.GGUFFile.metadata_only: kilobytes to a few megabytes) under its model key, only when
the stored copy differs; a producer keeps the copy it fetched in its cache (<cache>/headers/<sha>.gguf),
so the next run reads it from disk. The live workers' KV capacities (LLMWorker's rqllm_kv_tokens) are the
other half of the plan: pipeline.summarize.run sizes chunks by the smallest.
"""
from __future__ import annotations

import base64
import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

from redis import Redis

from engine.files import atomic_write
from jobs import keys
from jobs.keys import dumps
from jobs.schemas import InvalidJob, model_key

HEADER_TTL = 30 * 24 * 3600  # a worker started since renews it


def header_key(model: str) -> str:
    return keys.model_header_key(model_key(model))


def publish(connection: Redis, model: str, engine: Any) -> None:
    """Store `engine`'s model header under its model key, unless the same one is there (values are JSON,
    as every value under our keys: the bytes travel zlib-compressed in base64)."""
    gguf = getattr(getattr(engine, "model", None), "gguf", None)
    if gguf is None:
        return
    blob = gguf.metadata_only()
    sha = hashlib.sha256(blob).hexdigest()
    k = header_key(model)
    if connection.hget(k, "sha") != dumps(sha).encode():
        packed = base64.b64encode(zlib.compress(blob, 6)).decode("ascii")
        connection.hset(k, mapping={"sha": dumps(sha), "gguf": dumps(packed)})
    connection.expire(k, HEADER_TTL)


def cached_header(connection: Redis, model: str, cache_dir: Path) -> Path | None:
    """A local GGUF (no tensors) holding the tokenizer and template the workers of `model` published,
    fetched once into cache_dir; None when no worker has published one."""
    k = header_key(model)
    raw_sha = connection.hget(k, "sha")
    if not raw_sha:
        return None
    sha = json.loads(raw_sha)
    path = cache_dir / f"{sha}.gguf"
    if path.is_file():
        return path
    raw = connection.hget(k, "gguf")
    try:
        blob = zlib.decompress(base64.b64decode(json.loads(raw))) if raw else b""
    except (ValueError, zlib.error):
        return None
    if hashlib.sha256(blob).hexdigest() != sha:
        return None  # replaced meanwhile by another worker's: the next run finds that one
    with atomic_write(path) as f:
        f.write(blob)
    return path


def live_kv_tokens(workers: list[dict[str, Any]], model: str) -> int | None:
    """The smallest KV capacity (tokens) among the live workers of `model` that publish one; None if none."""
    key = model_key(model)
    found = []
    for w in workers:
        try:
            if w.get("model") and w.get("kv_tokens") and model_key(w["model"]) == key:
                found.append(int(w["kv_tokens"]))
        except InvalidJob:
            pass  # a worker started under a name no job can reach
    return min(found) if found else None
