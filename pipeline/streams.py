"""Redis Streams: a job's token stream (written while it generates) and a batch's events stream.

Token stream `rqllm:tokens:<job_id>`, one field `d` holding JSON per entry:
    {"type": "start", "attempt": n, "worker": name}   a (re)run begins: readers drop earlier text
    {"type": "text", "text": "..."}                    text produced since the previous chunk
    {"type": "interrupted"}                            the run stopped (worker shut down); it will rerun
    {"type": "end", "status": "done"|"failed", ...}    the job ended (written with the stored result)
Chunks are batched by time (every `interval` seconds, 50 ms by default) so a fast decoder costs
Redis one XADD per interval rather than one per token. `XADD MAXLEN ~` caps the stream and the
key carries a TTL.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobs import keys
from jobs.ledger import DEFAULT_STREAM_MAXLEN, dumps

if TYPE_CHECKING:
    from redis import Redis


class TokenStreamWriter:
    """Appends a job's text to its stream, at most one XADD per `interval` seconds."""

    def __init__(
        self,
        connection: Redis,
        job_id: str,
        *,
        ttl: int,
        maxlen: int = DEFAULT_STREAM_MAXLEN,
        interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.connection = connection
        self.key = keys.token_stream_key(job_id)
        self.ttl = max(1, int(ttl))
        self.maxlen = maxlen
        self.interval = interval
        self._clock = clock
        self._buf: list[str] = []
        self._last_flush = clock()
        self.xadds = 0

    def start(self, attempt: int, worker: str) -> None:
        """A new run: earlier text (from an interrupted or failed attempt) is dropped."""
        with self.connection.pipeline(transaction=True) as p:
            p.delete(self.key)
            p.xadd(self.key, {"d": dumps({"type": "start", "attempt": attempt, "worker": worker})},
                   maxlen=self.maxlen, approximate=True)
            p.expire(self.key, self.ttl)
            p.execute()
        self._buf.clear()
        self._last_flush = self._clock()

    def add(self, text: str) -> None:
        if text:
            self._buf.append(text)
        if self._buf and self._clock() - self._last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        text = self.take()
        if text:
            self.connection.xadd(self.key, {"d": dumps({"type": "text", "text": text})},
                                 maxlen=self.maxlen, approximate=True)
            self.xadds += 1

    def take(self) -> str:
        """Pending text not yet written (the caller writes it, e.g. atomically with the end marker)."""
        text = "".join(self._buf)
        self._buf.clear()
        self._last_flush = self._clock()
        return text

    def mark(self, entry: dict[str, Any]) -> None:
        self.flush()
        self.connection.xadd(self.key, {"d": dumps(entry)}, maxlen=self.maxlen, approximate=True)


@dataclass
class StreamEntry:
    id: str
    data: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.data.get("type", ""))


def _decode(entries: list) -> list[StreamEntry]:
    out = []
    for entry_id, fields in entries:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = fields.get(b"d", fields.get("d"))
        try:
            data = json.loads(raw) if raw is not None else {}
        except (TypeError, ValueError):
            data = {}
        out.append(StreamEntry(eid, data))
    return out


def read_stream(connection: Redis, key: str, last_id: str = "0", *, block_ms: int | None = None,
                count: int | None = None) -> list[StreamEntry]:
    """Entries after last_id (blocking up to block_ms when there are none)."""
    reply = connection.xread({key: last_id}, count=count, block=block_ms)
    if not reply:
        return []
    return _decode(reply[0][1])


def read_all(connection: Redis, key: str) -> list[StreamEntry]:
    return _decode(connection.xrange(key, "-", "+"))


def follow_tokens(connection: Redis, job_id: str, *, block_ms: int = 1000,
                  idle: Callable[[], bool] | None = None) -> Iterator[StreamEntry]:
    """Yields a job's token-stream entries from the start until its end marker.

    Works before the job started (waits for the stream to appear) and after it finished (replays).
    `idle()` is called whenever a block times out; returning False stops following.
    """
    key = keys.token_stream_key(job_id)
    last = "0"
    while True:
        entries = read_stream(connection, key, last, block_ms=block_ms, count=500)
        if not entries:
            if idle is not None and not idle():
                return
            continue
        for e in entries:
            last = e.id
            yield e
            if e.type == "end":
                return


def final_text(entries: list[StreamEntry]) -> str:
    """The text of the last run in a list of token-stream entries."""
    parts: list[str] = []
    for e in entries:
        if e.type == "start":
            parts = []
        elif e.type == "text":
            parts.append(str(e.data.get("text", "")))
    return "".join(parts)
