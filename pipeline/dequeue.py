"""The worker's loss-free priority dequeue: one job id from the first non-empty queue, never lost.

rq's Queue.dequeue_any uses BLMOVE (atomic, into the queue's intermediate list) only for a single
queue; for several queues (our high/default/low) it uses BLPOP, and a worker dying between the pop
and registering the job loses it (rq #1716). This tries a non-blocking LMOVE on each queue in priority
order: each job id lands atomically in that queue's intermediate list, with a short-lived "popped"
mark; if the worker dies before registering the job, the reaper (pipeline.recovery) puts the id back
at the front of its queue once the mark has expired.
"""
from __future__ import annotations

import json
from typing import Any

from rq.job import Job
from rq.utils import as_text

from jobs import keys
from pipeline.recovery import POPPED_MARK_TTL

# KEYS: queue1, intermediate1, queue2, intermediate2, ... (priority order)
# ARGV[1]: job key prefix, ARGV[2]: popped-mark prefix (jobs.keys), ARGV[3]: worker name, ARGV[4]: mark ttl
_POP_FIRST = """
for i = 1, #KEYS, 2 do
  local id = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT')
  if id then
    redis.call('SET', ARGV[2] .. id, ARGV[3], 'EX', ARGV[4])
    return {(i + 1) / 2, id, redis.call('HGETALL', ARGV[1] .. id)}
  end
end
return false
"""



class PriorityDequeue:
    def __init__(self, connection: Any, *, popped_by: str):
        self.connection = connection
        self.popped_by = json.dumps(popped_by)  # every rqllm:* value is JSON
        self._script = connection.register_script(_POP_FIRST)

    def pop(self, queues: list[Any], job_class: type[Job], serializer: Any) -> tuple[Job, Any] | None:
        """One round trip: LMOVE from the first non-empty queue in priority order into that queue's
        intermediate list, and read the job hash (as Job.fetch would)."""
        keys_ = [k for q in queues for k in (q.key, q.intermediate_queue_key)]
        while True:
            reply = self._script(keys=keys_, args=[job_class.redis_job_namespace_prefix, keys.POPPED_KEY_PREFIX,
                                                   self.popped_by, POPPED_MARK_TTL])
            if not reply:
                return None
            idx, raw_id, flat = reply
            queue = queues[int(idx) - 1]
            job_id = as_text(raw_id)
            if not flat:
                self.connection.lrem(queue.intermediate_queue_key, 1, job_id)  # job hash gone: skip it
                continue
            job = job_class(job_id, connection=self.connection, serializer=serializer)
            job.restore(dict(zip(flat[::2], flat[1::2])))
            return job, queue
