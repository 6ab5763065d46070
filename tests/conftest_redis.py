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
