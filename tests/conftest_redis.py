"""Fixtures for the queue tests (import them explicitly: `from tests.conftest_redis import ...`).

redis_url: a clean database per test (FLUSHDB before; on a shared REDIS_URL use a spare db number).
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis import Redis

from tests.redis_server import redis_server  # noqa: F401  (fixture re-exported)


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:  # noqa: F811
    conn = Redis.from_url(redis_server)
    conn.flushdb()
    try:
        yield redis_server
    finally:
        conn.close()


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[Redis]:
    conn = Redis.from_url(redis_url)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def client(redis_url: str):
    from pipeline.client import Client

    c = Client(redis_url)
    try:
        yield c
    finally:
        c.connection.close()


def _decodes(raw: bytes) -> str:
    """How a stored value decodes: 'json', 'zlib-json', 'b64-json', 'b64-zlib' or 'text'.
    Raises AssertionError for anything else (e.g. a pickle)."""
    import base64
    import binascii
    import json
    import zlib

    try:
        json.loads(raw)
        return "json"
    except ValueError:
        pass
    try:
        json.loads(zlib.decompress(raw))
        return "zlib-json"
    except (zlib.error, ValueError):
        pass
    try:
        b = base64.b64decode(raw, validate=True)
        try:
            json.loads(b)
            return "b64-json"
        except ValueError:
            zlib.decompress(b).decode("utf-8")
            return "b64-zlib"
    except (binascii.Error, ValueError, zlib.error):
        pass
    text = raw.decode("utf-8")  # UnicodeDecodeError for binary blobs (a pickle starts with 0x80)
    assert "\x80" not in text
    return "text"


def raw_values(conn: Redis) -> list[tuple[str, str, bytes]]:
    """(key, field, raw value) for every value stored in the database."""
    out: list[tuple[str, str, bytes]] = []
    for key in conn.scan_iter(count=1000):
        k = key.decode()
        t = conn.type(key).decode()
        if t == "string":
            out.append((k, "", conn.get(key)))
        elif t == "hash":
            out.extend((k, f.decode(), v) for f, v in conn.hgetall(key).items())
        elif t == "list":
            out.extend((k, str(i), v) for i, v in enumerate(conn.lrange(key, 0, -1)))
        elif t == "set":
            out.extend((k, "", v) for v in conn.smembers(key))
        elif t == "zset":
            out.extend((k, "", v) for v in conn.zrange(key, 0, -1))
        elif t == "stream":
            for eid, fields in conn.xrange(key):
                out.extend((k, f"{eid.decode()}.{f.decode()}", v) for f, v in fields.items())
        else:
            raise AssertionError(f"unexpected key type {t} for {k}")
    return out


def assert_no_pickle(conn: Redis) -> dict[str, int]:
    """Every value in Redis is JSON (maybe zlib/base64 wrapped, as rq stores job data and results) or
    plain UTF-8 text; rq's payload fields must be JSON. Returns counts per decoding."""
    import pickle
    import re

    counts: dict[str, int] = {}
    for key, field, raw in raw_values(conn):
        assert not raw.startswith(b"\x80"), f"pickle opcode at start of {key} {field}"
        for proto in (2, 3, 4, 5):
            assert not raw.startswith(bytes([0x80, proto])), (key, field)
        try:
            kind = _decodes(raw)
        except (AssertionError, UnicodeDecodeError) as e:
            raise AssertionError(f"{key} {field!r} is neither JSON nor text: {raw[:40]!r}") from e
        if key.startswith("rq:job:") and field in ("data", "meta", "result"):
            assert kind in ("json", "zlib-json"), (key, field, kind)
        if key.startswith("rq:results:") and field.endswith(".return_value"):
            assert kind == "b64-json", (key, field, kind)
        if key.startswith("rqllm:"):
            if field == "" and conn.type(key) in (b"set", b"zset"):
                # index members are ids (batch ids in a job's waiting set, the batches index)
                assert re.fullmatch(rb"[A-Za-z0-9_-]+", raw), (key, raw)
            else:
                assert kind == "json", f"{key} {field!r} is not JSON: {raw[:60]!r}"
        counts[kind] = counts.get(kind, 0) + 1
        try:
            pickle.loads(raw)
        except Exception:  # noqa: BLE001
            pass
        else:
            # Small ints/strings are never pickles; any value that unpickles is a finding.
            raise AssertionError(f"{key} {field!r} unpickles")
    return counts


@pytest.fixture
def spawn_worker(redis_url: str, tmp_path):
    """Start real worker processes (the production command) on the test Redis; stopped at teardown.

        w = spawn_worker(model, threads=1, extra=["--heartbeat-interval", "1"])
    """
    from pipeline.embedded import WorkerProcess, stop_workers, worker_argv

    procs = []

    def start(model: str = "smollm2-135m", *, name: str | None = None, threads: int | None = 1,
              kv_budget: str | None = None, burst: bool = False, extra: list[str] | None = None):
        name = name or f"test-worker-{len(procs)}"
        cmd = worker_argv(redis_url, model, threads=threads, kv_budget=kv_budget, burst=burst, name=name,
                             extra=extra)
        w = WorkerProcess(cmd, str(tmp_path / f"{name}.log"))
        w.name = name
        procs.append(w)
        return w

    yield start
    stop_workers(procs)


def wait_for_workers(conn: Redis, names: list[str], timeout: float = 120.0) -> None:
    """Block until the named workers registered (their engine is loaded by then)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(conn.exists(f"rq:worker:{n}") for n in names):
            return
        time.sleep(0.1)
    raise TimeoutError(f"workers {names} did not start within {timeout} s")
