"""Redis connections and the one serializer rqllm uses with rq (JSON: nothing is ever pickled)."""
from __future__ import annotations

import os

from redis import Redis
from rq.serializers import JSONSerializer

SERIALIZER = JSONSerializer
ENV_VAR = "REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


def redis_url_from_env() -> str | None:
    """REDIS_URL when set (non-empty), else None (callers then use the embedded server or fail)."""
    url = os.environ.get(ENV_VAR, "").strip()
    return url or None


def connect(url: str | None = None, **kwargs) -> Redis:
    """A Redis client for url (or REDIS_URL, or the local default). Replies stay bytes (rq needs that)."""
    url = url or redis_url_from_env() or DEFAULT_URL
    kwargs.setdefault("health_check_interval", 30)
    return Redis.from_url(url, **kwargs)
