"""The two atomic transitions that keep batches and jobs consistent, as Lua scripts.

* claim (producer, per job of a batch): a finished (done) result is reused -> the batch is told at once;
  otherwise the batch is added to the job's waiting set, and the caller enqueues the job unless rq
  already has it queued/started (another batch is waiting for the same content).
* finish (worker, or anyone recording a failure): store the JobResult, close the job's token stream
  with an end marker, and for every waiting batch bump its done/failed counter and append an event.

Because both run atomically in Redis, a batch either sees the stored result (claim after finish)
or is in the waiting set when the job ends (claim before finish): no announcement can be lost.
The scripts touch batch keys they compute from ids, so they need a single (non-cluster) Redis.
"""
from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from redis.client import Pipeline
from rq.job import Job

from jobs import keys
from jobs.keys import dumps
from jobs.schemas import JobResult
from jobs.streams import (DEFAULT_STREAM_MAXLEN, end_entry, lua_skip_if_last_entry_has, lua_xadd, text_entry)

if TYPE_CHECKING:
    from redis import Redis

# KEYS: result, waiting set, token stream
# ARGV: result json, status, result ttl, stream ttl, stream maxlen, last text entry json ('' = none),
#       end entry json, job id, only_if_absent ('1'/'0'), write id (JSON string, new for every finish),
#       batch key prefix, batch events key suffix (jobs.keys: the waiting batches are known only here)
# The end marker carries the write id. redis-py resends a command whose reply a dropped connection (a
# Redis restart) lost; if the stream's last entry is this finish's own end marker, the script already
# ran in full (it is atomic) and the resend returns 0 without writing the last text and marker again.
_FINISH = lua_skip_if_last_entry_has("KEYS[3]", "ARGV[10]") + """if ARGV[9] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
if ARGV[6] ~= '' then
  """ + lua_xadd("KEYS[3]", "ARGV[6]", maxlen="ARGV[5]") + """\
end
""" + lua_xadd("KEYS[3]", "ARGV[7]", maxlen="ARGV[5]", write_id="ARGV[10]") + """\
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
local batches = redis.call('SMEMBERS', KEYS[2])
redis.call('DEL', KEYS[2])
local field = 'failed'
if ARGV[2] == 'done' then field = 'done' end
local ev = cjson.encode({job = ARGV[8], status = ARGV[2]})
local told = 0
for _, b in ipairs(batches) do
  local bkey = ARGV[11] .. b
  local ttl = redis.call('TTL', bkey)
  if ttl ~= -2 then
    redis.call('HINCRBY', bkey, field, 1)
    local ekey = bkey .. ARGV[12]
    """ + lua_xadd("ekey", "ev") + """\
    if ttl > 0 then redis.call('EXPIRE', ekey, ttl) end
    told = told + 1
  end
end
return told
"""

# KEYS: result, waiting set, rq job hash, batch hash, batch events
# ARGV: batch id, job id, recompute ('1'/'0'), waiting-set ttl
_CLAIM = """
local batch = ARGV[1]
local res = redis.call('GET', KEYS[1])
if res and ARGV[3] ~= '1' then
  local ok, obj = pcall(cjson.decode, res)
  if ok and type(obj) == 'table' and obj['status'] == 'done' then
    if batch ~= '' then
      redis.call('HINCRBY', KEYS[4], 'done', 1)
      redis.call('HINCRBY', KEYS[4], 'cached', 1)
      """ + lua_xadd("KEYS[5]", "cjson.encode({job = ARGV[2], status = 'done', cached = true})") + """\
    end
    return 'cached'
  end
end
if res then redis.call('DEL', KEYS[1]) end
if batch ~= '' then
  redis.call('SADD', KEYS[2], batch)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
local status = redis.call('HGET', KEYS[3], 'status')
if status == 'queued' or status == 'started' or status == 'deferred' or status == 'scheduled' then
  return 'joined'
end
return 'enqueue'
"""


class Ledger:
    """Scripts bound to one connection (redis-py loads them lazily, also inside pipelines)."""

    def __init__(self, connection: Redis):
        self.connection = connection
        self._finish = connection.register_script(_FINISH)
        self._claim = connection.register_script(_CLAIM)

    def finish(
        self,
        result: JobResult,
        *,
        result_ttl: int,
        stream_ttl: int,
        last_text: str = "",
        only_if_absent: bool = False,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        client: Any = None,
    ) -> int:
        """Record a job's outcome and tell its waiting batches. Returns how many batches were told, -1 if
        only_if_absent and a result was already there, 0 when the call was a resend of one already applied."""
        end = end_entry(result.status, result.finish_reason,
                        result.error.model_dump() if result.error is not None else None)
        chunk = dumps(text_entry(last_text)) if last_text else ""
        reply = self._finish(
            keys=[keys.result_key(result.job_id), keys.job_batches_key(result.job_id), keys.token_stream_key(result.job_id)],
            args=[
                result.model_dump_json(),
                result.status,
                max(1, int(result_ttl)),
                max(1, int(stream_ttl)),
                int(stream_maxlen),
                chunk,
                dumps(end),
                result.job_id,
                "1" if only_if_absent else "0",
                json.dumps(uuid.uuid4().hex),  # what makes a resend of this very call recognisable
                keys.BATCH_KEY_PREFIX,
                keys.BATCH_EVENTS_SUFFIX,
            ],
            client=client,
        )
        return 0 if isinstance(reply, Pipeline) else int(reply)

    def claim(self, pipe: Any, batch_id: str, job_id: str, *, recompute: bool, waiting_ttl: int) -> None:
        """Queue a claim on a pipeline; its reply is 'cached', 'joined' or 'enqueue'.
        batch_id '' claims for a standalone job (no batch to tell)."""
        self._claim(
            keys=[
                keys.result_key(job_id),
                keys.job_batches_key(job_id),
                Job.key_for(job_id),
                keys.batch_key(batch_id),
                keys.batch_events_key(batch_id),
            ],
            args=[batch_id, job_id, "1" if recompute else "0", max(1, int(waiting_ttl))],
            client=pipe,
        )
