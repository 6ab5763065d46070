"""Redis connections and the one serializer rqllm uses with rq (JSON: nothing is ever pickled).

Every rqllm connection (producer, worker, collector, watch) comes from `connect()`, which sets up
redis-py's own reconnect: a command that hits ConnectionError/TimeoutError (Redis restarting, a
dropped socket) reconnects and is retried with exponential backoff (0.05 s doubling up to 2 s, about
30 s in all) before the error reaches the caller. A Redis restart of a few seconds is therefore
invisible to rq's worker loop, the heartbeat thread and the collector; longer outages surface as
ConnectionError, which the worker (pipeline.worker.run_worker) and collector handle by waiting.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import redis.exceptions
from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from rq.serializers import JSONSerializer

SERIALIZER = JSONSerializer
ENV_VAR = "REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

RETRY_BACKOFF_BASE = 0.05  # seconds before the first retry; doubles each time
RETRY_BACKOFF_CAP = 2.0
RETRY_ATTEMPTS = 20  # 0.05 + 0.1 + ... + 2 + 2 ... ~= 31 s of retrying in all
REDIS_DOWN_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, socket.timeout)


# Redis answered and said no: waiting cures nothing. redis-py makes these ConnectionError subclasses,
# so they would be retried for ~30 s and then caught as "Redis down" by the loops that wait for Redis.
REDIS_REFUSAL_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)


class RedisRefused(redis.exceptions.RedisError):
    """Redis refused us (wrong password, missing permission). Not a ConnectionError on purpose."""


class _ReconnectRetry(Retry):
    """redis-py's Retry with backoff, except that a refusal is raised at once as RedisRefused."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            return not isinstance(error, REDIS_REFUSAL_ERRORS) and (is_retryable is None or is_retryable(error))

        try:
            return super().call_with_retry(do, fail, retryable, with_failure_count)
        except REDIS_REFUSAL_ERRORS as e:
            raise RedisRefused(f"Redis refused the connection: {e} (check the password or user in REDIS_URL)") from e


class PlaceholderPassword(RedisRefused, ValueError):
    """REDIS_URL holds a placeholder password from deploy/rqllm.env.example: refused before connecting."""


# The example .env's placeholder starts so (REDIS_PASSWORD=change-me-to-...; the rq-dashboard one is gone with it)
PLACEHOLDER_PASSWORD_PREFIX = "change-me"


def refuse_placeholder_password(url: str) -> None:
    """PlaceholderPassword when the URL's password (user:password@ or ?password=) is one of the example
    .env's placeholders: a server left with it is open to anyone who read the example."""
    from urllib.parse import parse_qs, unquote, urlsplit

    try:
        parts = urlsplit(url)
        found = [unquote(parts.password or "")] + parse_qs(parts.query).get("password", [])
    except ValueError:
        return  # not a URL we can read: redis-py says what is wrong with it
    if any(pw.strip().lower().startswith(PLACEHOLDER_PASSWORD_PREFIX) for pw in found):
        raise PlaceholderPassword("the Redis URL holds the placeholder password of deploy/rqllm.env.example "
                                  "('change-me...'): set a real one in .env (openssl rand -hex 24) and in REDIS_URL")


def reconnect_policy() -> Retry:
    return _ReconnectRetry(ExponentialBackoff(cap=RETRY_BACKOFF_CAP, base=RETRY_BACKOFF_BASE), RETRY_ATTEMPTS,
                           supported_errors=REDIS_DOWN_ERRORS)


def redis_url_from_env() -> str | None:
    """REDIS_URL when set (non-empty), else None (callers then use the embedded server or fail)."""
    url = os.environ.get(ENV_VAR, "").strip()
    return url or None


def is_unix_socket_url(url: str) -> bool:
    """unix:///path/redis.sock (the embedded server's): TCP-only options (socket_keepalive) do not apply."""
    return url.strip().lower().startswith("unix:")


def tcp_options(url: str, **options) -> dict:
    """`options` for a TCP URL, none for a unix socket one (redis-py refuses socket_keepalive there)."""
    return {} if is_unix_socket_url(url) else options


def connect(url: str | None = None, **kwargs) -> Redis:
    """A Redis client for url (or REDIS_URL, or the local default) that reconnects with backoff.
    Replies stay bytes (rq needs that)."""
    url = url or redis_url_from_env() or DEFAULT_URL
    refuse_placeholder_password(url)
    kwargs.setdefault("health_check_interval", 30)
    kwargs.setdefault("retry", reconnect_policy())
    kwargs.setdefault("retry_on_error", list(REDIS_DOWN_ERRORS))
    kwargs.setdefault("socket_connect_timeout", 5)
    for key, value in tcp_options(url, socket_keepalive=True).items():
        kwargs.setdefault(key, value)
    return Redis.from_url(url, **kwargs)


def wait_for_redis(connection: Redis, *, stop: Callable[[], bool] = lambda: False,
                   log: Callable[[str], None] = lambda msg: None, max_wait: float = 30.0) -> bool:
    """Block until `connection` answers PING (backing off up to max_wait between tries) or stop() is true.
    Returns whether Redis answered."""
    delay = 1.0
    while not stop():
        try:
            if connection.ping():
                return True
        except REDIS_DOWN_ERRORS as e:
            log(f"Redis still unreachable ({e}); next try in {delay:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, max_wait)
    return False
