"""Redis connections and the one serializer rqllm uses with rq (JSON: nothing is ever pickled).

Every rqllm connection (producer, worker, collector, watch) comes from `connect()`, which sets up
redis-py's own reconnect: a command that hits ConnectionError/TimeoutError (Redis restarting, a
dropped socket) reconnects and is retried with exponential backoff (0.05 s doubling up to 2 s, about
30 s in all) before the error reaches the caller. A Redis restart of a few seconds is therefore
invisible to rq's worker loop, the heartbeat thread and the collector; longer outages surface as
ConnectionError, which the worker (pipeline.worker.run_worker) and collector handle by waiting.

The first contact is different: a Redis that is not there at all should be said at once, not after
30 s of retries. `probe()` pings once, without retries and with a short timeout, and raises
RedisUnreachable naming the address and the reason; commands call it through `reachable()`, and
`wait_for_redis` (the worker's start, every outage) probes the same way between its backoff sleeps.
"""
from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable

import redis.exceptions
from redis import Redis
from redis import ConnectionPool
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from rq.serializers import JSONSerializer

SERIALIZER = JSONSerializer
ENV_VAR = "REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

RETRY_BACKOFF_BASE = 0.05  # seconds before the first retry; doubles each time
RETRY_BACKOFF_CAP = 2.0
RETRY_ATTEMPTS = 20  # 0.05 + 0.1 + ... + 2 + 2 ... ~= 31 s of retrying in all
REDIS_DOWN_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, socket.timeout)
PROBE_TIMEOUT = 3.0  # seconds a first contact (connect, then PING) may take before "unreachable"
WAIT_BACKOFF_CAP = 30.0  # wait_for_redis: the longest sleep between two probes


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


class RedisUnreachable(redis.exceptions.RedisError):
    """Redis did not answer a first contact (probe): the message names where and why, on one line."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot reach Redis at {address}: {reason}")
        self.address, self.reason = address, reason


def describe_address(connection: Redis) -> str:
    """Where `connection` goes, without credentials: redis://host:port/db or unix:///path?db=n."""
    kw = connection.connection_pool.connection_kwargs
    db = kw.get("db", 0)
    if kw.get("path"):
        return f"unix://{kw['path']}?db={db}"
    scheme = "rediss" if "ssl" in getattr(connection.connection_pool.connection_class, "__name__", "").lower() else "redis"
    return f"{scheme}://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{db}"


_REDIS_PY_REASON = re.compile(r"^Error -?\d+ connecting to .*?\.\s+(?P<reason>.+?)\.?$")


def _reason(error: BaseException) -> str:
    """redis-py's "Error 111 connecting to 127.0.0.1:1. Connection refused." -> "connection refused"."""
    text = " ".join(str(error).split()) or type(error).__name__
    m = _REDIS_PY_REASON.match(text)
    text = m.group("reason") if m else text.rstrip(".")
    return text[:1].lower() + text[1:]


def _probe_client(connection: Redis, timeout: float) -> Redis:
    """A one-off client to the same place as `connection` that tries once (no reconnect policy)."""
    pool = connection.connection_pool
    kw = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0), "socket_timeout": timeout,
          "socket_connect_timeout": timeout, "health_check_interval": 0}
    kw.pop("retry_on_error", None)
    return Redis(connection_pool=ConnectionPool(connection_class=pool.connection_class, **kw))


def probe(connection: Redis, timeout: float = PROBE_TIMEOUT) -> None:
    """PING once, within `timeout` seconds; RedisUnreachable (the address and the reason, one line)
    when Redis does not answer, RedisRefused when it answers no (password)."""
    client = _probe_client(connection, timeout)
    try:
        client.ping()
    except REDIS_REFUSAL_ERRORS as e:
        raise RedisRefused(f"Redis refused the connection at {describe_address(connection)}: {e} "
                           "(check the password or user in REDIS_URL)") from None
    except redis.exceptions.RedisError as e:  # down, a timeout, or something that is not Redis answering
        raise RedisUnreachable(describe_address(connection), _reason(e)) from None
    finally:
        client.close()


def reachable(url: str | None = None, timeout: float = PROBE_TIMEOUT, **kwargs) -> Redis:
    """connect(url), after one probe: a Redis that is not there fails within `timeout` seconds, in one line."""
    connection = connect(url, **kwargs)
    probe(connection, timeout)
    return connection


def wait_for_redis(connection: Redis, *, stop: Callable[[], bool] = lambda: False,
                   log: Callable[[str], None] = lambda msg: None, max_wait: float = WAIT_BACKOFF_CAP) -> bool:
    """Block until `connection`'s Redis answers a probe (backing off 1 s, 2 s, 4 s ... up to max_wait
    between tries) or stop() is true. Logs "waiting for Redis at <address>" at once and before every
    later try. Returns whether Redis answered."""
    delay = 1.0
    while not stop():
        try:
            probe(connection)
            return True
        except RedisUnreachable as e:
            log(f"waiting for Redis at {e.address} ({e.reason}); next try in {delay:.0f} s")
        end = time.monotonic() + delay
        while time.monotonic() < end and not stop():
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        delay = min(delay * 2, max_wait)
    return False
