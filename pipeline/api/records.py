"""Pydantic records as Redis hashes (one JSON value per field), and cursor pages over a per-owner index."""
from __future__ import annotations

import json
from typing import Any

from redis import Redis

from jobs.keys import dumps
from pipeline.api.errors import APIError


def to_hash(fields: dict[str, Any]) -> dict[str, str]:
    return {k: dumps(v) for k, v in fields.items()}


def from_hash(raw: dict[bytes, bytes]) -> dict[str, Any]:
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def page_ids(connection: Redis, index_key: str, *, after: str | None, limit: int,
             newest_first: bool = True) -> tuple[list[str], bool]:
    """Ids after the cursor `after` (exclusive) in the index's order; and whether more follow."""
    start = 0
    if after:
        rank = connection.zrevrank(index_key, after) if newest_first else connection.zrank(index_key, after)
        if rank is None:
            raise APIError(400, f"`after` names no object of yours: {after!r}", param="after", code="invalid_value")
        start = int(rank) + 1
    fetch = connection.zrevrange if newest_first else connection.zrange
    raw = fetch(index_key, start, start + limit)  # one more than asked: tells whether more follow
    ids = [r.decode() for r in raw]
    return ids[:limit], len(ids) > limit
