"""Redis Streams: a job's token stream (written while it generates) and a batch's events stream.

The one module that knows how a stream entry looks: Python writers and readers use the functions
below, and the Lua scripts that append entries atomically with other writes (jobs.ledger's finish and
claim) take their XADD lines from lua_xadd() here.

Token stream `rqllm:tokens:<job_id>`, one field `d` holding JSON per entry:
    {"type": "start", "attempt": n, "worker": name}   a (re)run begins: readers drop earlier text
                                                       (n counts runs of this job: a run that left no
                                                       end marker - its worker died - makes the next n+1)
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
from jobs.keys import dumps

if TYPE_CHECKING:
    from redis import Redis

DEFAULT_STREAM_MAXLEN = 10_000
ENTRY_FIELD = "d"  # the entry's JSON
WRITE_ID_FIELD = "w"  # the write id that makes a resent append recognisable


def text_entry(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def end_entry(status: str, finish_reason: str | None, error: dict[str, Any] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "end", "status": status, "finish_reason": finish_reason}
    if error is not None:
        entry["error"] = error
    return entry


def lua_xadd(stream_key: str, entry_json: str, *, maxlen: str | None = None, write_id: str | None = None) -> str:
    """One Lua line that appends an entry (its JSON in the Lua expression `entry_json`), capped at
    `maxlen` and carrying `write_id` when given: the format every script writes entries in."""
    cap = f"'MAXLEN', '~', {maxlen}, " if maxlen is not None else ""
    tail = f", '{WRITE_ID_FIELD}', {write_id}" if write_id is not None else ""
    return f"redis.call('XADD', {stream_key}, {cap}'*', '{ENTRY_FIELD}', {entry_json}{tail})\n"


def lua_skip_if_last_entry_has(stream_key: str, write_id: str) -> str:
    """Lua that returns 0 when the stream's last entry carries this write id: the one repeat guard of
    every token-stream write (a resent command must not write twice)."""
    return f"""
local last = redis.call('XREVRANGE', {stream_key}, '+', '-', 'COUNT', 1)
if #last > 0 then
  local f = last[1][2]
  for i = 1, #f - 1, 2 do
    if f[i] == '{WRITE_ID_FIELD}' and f[i + 1] == {write_id} then return 0 end
  end
end
"""


# KEYS[1]: token stream. ARGV: attempt (as rq counts it), worker name, maxlen, ttl. Returns the attempt.
# The attempt number comes from the stream itself when the previous run never ended (a SIGKILLed worker
# writes no marker, and rq's abandoned-job retry does not count in number_of_retries).
_START = """
local attempt = tonumber(ARGV[1])
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #first > 0 and #last > 0 then
  local ok1, f = pcall(cjson.decode, first[1][2][2])
  local ok2, l = pcall(cjson.decode, last[1][2][2])
  if ok1 and ok2 and type(f) == 'table' and type(l) == 'table' and f['type'] == 'start'
      and l['type'] ~= 'end' and tonumber(f['attempt']) then
    attempt = math.max(attempt, tonumber(f['attempt']) + 1)
  end
end
redis.call('DEL', KEYS[1])
""" + lua_xadd("KEYS[1]", "cjson.encode({type = 'start', attempt = attempt, worker = ARGV[2]})", maxlen="ARGV[3]") + """\
redis.call('EXPIRE', KEYS[1], ARGV[4])
return attempt
"""


# KEYS[1]: token stream. ARGV: write id, entry JSON, maxlen. Appends the entry unless the stream's last
# entry carries the same write id: redis-py retries a command whose reply was lost to a dropped
# connection (a Redis restart), and a plain XADD would then append the same text twice.
_APPEND = (lua_skip_if_last_entry_has("KEYS[1]", "ARGV[1]")
           + lua_xadd("KEYS[1]", "ARGV[2]", maxlen="ARGV[3]", write_id="ARGV[1]") + "return 1\n")


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
        self.attempt = 0
        self._writes = 0  # this writer's appends, numbered: the write id that makes a retried append a no-op
        self._append = connection.register_script(_APPEND)

    def start(self, attempt: int, worker: str) -> int:
        """A new run: earlier text (from an interrupted, failed or dead attempt) is dropped, and readers
        following the stream see a start marker, so they drop what they showed. Returns the attempt number
        written (higher than `attempt` when the previous run died without an end marker)."""
        script = self.connection.register_script(_START)
        self.attempt = int(script(keys=[self.key], args=[int(attempt), worker, int(self.maxlen), self.ttl]))
        self._buf.clear()
        self._last_flush = self._clock()
        return self.attempt

    def add(self, text: str) -> None:
        if text:
            self._buf.append(text)
        if self._buf and self._clock() - self._last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        text = self.take()
        if text:
            self.append(text_entry(text))
            self.xadds += 1

    def take(self) -> str:
        """Pending text not yet written (the caller writes it, e.g. atomically with the end marker)."""
        text = "".join(self._buf)
        self._buf.clear()
        self._last_flush = self._clock()
        return text

    def mark(self, entry: dict[str, Any]) -> None:
        self.flush()
        self.append(entry)

    def write_id(self) -> str:
        """Id of the latest append, as JSON (every field of our keys is JSON: nothing is unpickled)."""
        return json.dumps(f"{self.attempt}:{self._writes}")

    def append(self, entry: dict[str, Any]) -> None:
        """One entry, written at most once even when the connection drops and the call is retried."""
        self._writes += 1
        self._append(keys=[self.key], args=[self.write_id(), dumps(entry), int(self.maxlen)])


@dataclass
class StreamEntry:
    id: str
    data: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.data.get("type", ""))


def decode_entries(entries: list) -> list[StreamEntry]:
    """XREAD/XRANGE entries (from a sync or an asyncio client) as StreamEntry objects."""
    out = []
    for entry_id, fields in entries:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = fields.get(ENTRY_FIELD.encode(), fields.get(ENTRY_FIELD))
        try:
            data = json.loads(raw) if raw is not None else {}
        except (TypeError, ValueError):
            data = {}
        out.append(StreamEntry(eid, data))
    return out


def append_entry(pipe: Any, key: str, entry: dict[str, Any]) -> None:
    """Queue a plain append (no cap, no write id) of one entry on a client or pipeline: batch events."""
    pipe.xadd(key, {ENTRY_FIELD: dumps(entry)})


def read_stream(connection: Redis, key: str, last_id: str = "0", *, block_ms: int | None = None,
                count: int | None = None) -> list[StreamEntry]:
    """Entries after last_id (blocking up to block_ms when there are none)."""
    reply = connection.xread({key: last_id}, count=count, block=block_ms)
    if not reply:
        return []
    return decode_entries(reply[0][1])


def read_all(connection: Redis, key: str) -> list[StreamEntry]:
    return decode_entries(connection.xrange(key, "-", "+"))


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
