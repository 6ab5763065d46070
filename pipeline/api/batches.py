"""BatchStore: API batch records in Redis (jobs.keys.api_batch_key), one JSON value per field.

Counters (request_counts and usage) are separate integer fields the batch runner increments as lines
are written, so a GET shows progress without reading any file. Status changes that race (a cancel
against the runner moving on) go through one Lua script that changes the status only from the
statuses it is given.
"""
from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis

from jobs import keys
from jobs.keys import dumps
from pipeline.api.errors import not_found
from pipeline.api.records import from_hash, page_ids, to_hash
from pipeline.api.schemas import BatchRecord, BatchUsage, RequestCounts

COUNTERS = ("total", "completed", "failed", "input_tokens", "output_tokens")

# KEYS[1]: batch hash. ARGV: new status (JSON), timestamp field, timestamp (JSON), allowed statuses (JSON)...
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
for i = 4, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    return 1
  end
end
return 0
"""


class BatchStore:
    def __init__(self, connection: Redis):
        self.connection = connection
        self._transition = connection.register_script(_TRANSITION)

    def create(self, record: BatchRecord, home: str) -> None:
        """`home`: the id of the data directory holding the batch's files (ServeConfig.home_id)."""
        fields = {**record.model_dump(exclude={"request_counts", "usage"}), "home": home}
        counts = record.request_counts
        with self.connection.pipeline(transaction=True) as p:
            p.hset(keys.api_batch_key(record.id), mapping={**to_hash(fields), "total": counts.total,
                                                           "completed": 0, "failed": 0, "input_tokens": 0,
                                                           "output_tokens": 0})
            p.zadd(keys.api_batches_index_key(record.owner), {record.id: time.time()})  # finer than created_at
            p.sadd(keys.API_ACTIVE_BATCHES, record.id)
            p.execute()

    def get(self, batch_id: str) -> BatchRecord | None:
        raw = self.connection.hgetall(keys.api_batch_key(batch_id))
        if not raw:
            return None
        d = from_hash(raw)
        n = {k: int(d.pop(k, 0) or 0) for k in COUNTERS}
        d.pop("end_as", None)
        d.pop("home", None)
        d["request_counts"] = RequestCounts(total=n["total"], completed=n["completed"], failed=n["failed"])
        d["usage"] = BatchUsage(input_tokens=n["input_tokens"], output_tokens=n["output_tokens"],
                                total_tokens=n["input_tokens"] + n["output_tokens"])
        return BatchRecord.model_validate(d)

    def get_owned(self, batch_id: str, owner: str) -> BatchRecord:
        record = self.get(batch_id)
        if record is None or record.owner != owner:
            raise not_found("batch", batch_id)
        return record

    def field(self, batch_id: str, name: str) -> Any:
        raw = self.connection.hget(keys.api_batch_key(batch_id), name)
        return json.loads(raw) if raw is not None else None

    def update(self, batch_id: str, **fields: Any) -> None:
        self.connection.hset(keys.api_batch_key(batch_id), mapping=to_hash(fields))

    def transition(self, batch_id: str, allowed_from: tuple[str, ...], to: str, at_field: str | None = None) -> bool:
        """status := `to` (and `at_field` := now) only if the status is one of `allowed_from`."""
        at_field = at_field or f"{to}_at"
        return bool(self._transition(keys=[keys.api_batch_key(batch_id)],
                                     args=[dumps(to), at_field, dumps(int(time.time())),
                                           *[dumps(s) for s in allowed_from]]))

    def add_counts(self, batch_id: str, **deltas: int) -> None:
        key = keys.api_batch_key(batch_id)
        with self.connection.pipeline(transaction=False) as p:
            for name, delta in deltas.items():
                if delta:
                    p.hincrby(key, name, delta)
            p.execute()

    def set_counts(self, batch_id: str, **values: int) -> None:
        self.connection.hset(keys.api_batch_key(batch_id), mapping={k: int(v) for k, v in values.items()})

    def end(self, batch_id: str, status: str, **fields: Any) -> None:
        """The final status (with its *_at time) and fields; the batch leaves the active set."""
        with self.connection.pipeline(transaction=True) as p:
            p.hset(keys.api_batch_key(batch_id), mapping=to_hash({"status": status, f"{status}_at": int(time.time()),
                                                                  **fields}))
            p.srem(keys.API_ACTIVE_BATCHES, batch_id)
            p.execute()

    def active_totals(self, owner: str) -> list[int]:
        """The request lines (request_counts.total) of each of `owner`'s batches not yet ended."""
        ids = [b.decode() for b in self.connection.smembers(keys.API_ACTIVE_BATCHES)]
        with self.connection.pipeline(transaction=False) as p:
            for b in ids:
                p.hmget(keys.api_batch_key(b), "owner", "total")
            rows = p.execute()
        return [int(total or 0) for who, total in rows if who is not None and json.loads(who) == owner]

    def active_ids(self, home: str) -> list[str]:
        """Batches not yet ended whose files live in the data directory `home`."""
        ids = sorted(b.decode() for b in self.connection.smembers(keys.API_ACTIVE_BATCHES))
        return [b for b in ids if self.field(b, "home") in (home, None)]

    def list(self, owner: str, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        ids, more = page_ids(self.connection, keys.api_batches_index_key(owner), after=after, limit=limit)
        records = [r for r in (self.get(b) for b in ids) if r is not None]
        return records, more
