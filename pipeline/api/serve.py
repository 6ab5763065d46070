"""Process set-up for `rqllm serve`: the queue (REDIS_URL, or an embedded redis-server keeping its data
in the data directory), optional local workers, then uvicorn until SIGINT/SIGTERM.

Embedded mode gives a working server on a fresh machine with one command. Its redis-server keeps an
append-only file under <data dir>/redis, so a restarted server finds its files, batches and queued
jobs again; its children stop when the server dies, even by SIGKILL (pipeline.embedded).

Local workers are supervised (WorkerSupervisor): one that dies is started again, after 1 s, then 2, 4...
up to a minute while it keeps dying young. The job it was running is dealt with at once, not when its
heartbeat expires: a completion request waiting for it gets a `worker_lost` error (its client may send it
again), a batch job goes back to the front of its queue (pipeline.recovery's rules, its loss counted).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.cpus import choose_threads
from pipeline.api.auth import is_loopback
from pipeline.api.config import ServeConfig
from pipeline.embedded import RedisServer, WorkerProcess, stop_workers, worker_argv

log = logging.getLogger("rqllm.serve")

WORKER_STOP_GRACE = 10.0  # seconds for a worker to finish its job at shutdown before it is told to stop now
SUPERVISE_INTERVAL = 0.5  # seconds between the supervisor's looks at its workers
RESTART_FIRST_DELAY = 1.0  # a dead worker is started again after this long, doubling while it keeps dying
RESTART_MAX_DELAY = 60.0
HEALTHY_AFTER = 60.0  # a worker that ran this long starts from the first delay again


class ServeError(RuntimeError):
    pass


def check_exposure(host: str, config: ServeConfig) -> None:
    """No key means loopback only, unless the operator says otherwise."""
    if not config.api_keys and not config.insecure_no_auth and not is_loopback(host):
        raise ServeError(f"no API key configured: refusing to listen on {host} (reachable from other hosts). "
                         "Give --api-key / RQLLM_API_KEYS, listen on 127.0.0.1, or pass --insecure-no-auth.")


def end_lost_job(connection: Any, worker_name: str, how: str) -> tuple[str, str] | None:
    """The job a dead worker was running, dealt with now rather than when its heartbeat runs out (~20 s):
    with a completion request waiting for it (an API waiter), recorded failed `worker_lost` at once, and
    not run again (the client sees the error and may resend); otherwise given back to the front of its
    queue through pipeline.recovery's rules (its loss counted; failed after WORKER_LOSS_RETRIES).
    Returns (job id, what happened), or None when it was running none."""
    from rq import SimpleWorker
    from rq.job import Job, JobStatus
    from rq.registry import StartedJobRegistry

    from jobs import keys
    from jobs.outcomes import record_rq_failure
    from jobs.redis_conn import SERIALIZER
    from pipeline.recovery import WORKER_LOSS_RETRIES, Reaper

    worker = SimpleWorker.find_by_key(f"rq:worker:{worker_name}", connection=connection, serializer=SERIALIZER)
    job_id = worker.get_current_job_id() if worker is not None else None
    if not job_id:
        return None
    job_key = Job.key_for(job_id)
    status, origin = connection.hmget(job_key, "status", "origin")
    if status is None or status.decode() != JobStatus.STARTED or not origin:
        return None
    queue = origin.decode()
    if connection.scard(keys.api_waiters_key(job_id)):
        rq_job = Job.fetch(job_id, connection=connection, serializer=SERIALIZER)
        record_rq_failure(connection, rq_job, "worker_lost",
                          f"the worker running this request stopped ({how}); it is being restarted: send the "
                          "request again")
        # no rerun: the reaper below fails it in rq's books too (its failure record keeps ours)
        connection.hset(job_key, mapping={"retries_left": 0, "rqllm_worker_losses": WORKER_LOSS_RETRIES})
    registry = StartedJobRegistry(queue, connection=connection, serializer=SERIALIZER)
    for member in connection.zrange(registry.key, 0, -1):
        if member.decode().split(":")[0] == job_id:
            connection.zadd(registry.key, {member: 1}, xx=True)  # expired now: its worker is gone
    acted = dict(Reaper(connection, [queue], name=f"rqllm serve {os.getpid()}", restart_grace=0).run())
    return job_id, acted.get(job_id, "left to the next reaper pass")


@dataclass
class WorkerSlot:
    """One local worker: the process running now, and when to start another after it died."""

    model: str
    base_name: str
    process: WorkerProcess
    name: str = ""
    generation: int = 0
    started: float = field(default_factory=time.monotonic)
    delay: float = RESTART_FIRST_DELAY
    restart_at: float | None = None  # set while dead
    replaced: str | None = None  # the dead worker's name, unregistered once this one has registered

    def __post_init__(self) -> None:
        self.name = self.name or self.base_name


class WorkerSupervisor(threading.Thread):
    """Watches the local workers; starts one again when it dies (with backoff), after ending the job it
    ran (end_lost_job). The restarted workers are its children: their parent-death signal follows this
    thread, which lives until LocalProcesses.stop() has stopped them."""

    def __init__(self, redis_url: str, slots: list[WorkerSlot], spawn: Callable[[str, str], WorkerProcess],
                 on_replace: Callable[[WorkerProcess, WorkerProcess], None] = lambda old, new: None):
        super().__init__(name="rqllm-worker-supervisor", daemon=True)
        self.redis_url = redis_url
        self.slots = slots
        self.spawn = spawn
        self.on_replace = on_replace
        self.restarts = 0
        self._lock = threading.Lock()  # held during a pass; pause() waits for it
        self._paused = False
        self._exit = threading.Event()
        self._connection: Any = None

    @property
    def connection(self) -> Any:
        if self._connection is None:
            from jobs.redis_conn import connect

            self._connection = connect(self.redis_url)
        return self._connection

    def run(self) -> None:
        while not self._exit.wait(SUPERVISE_INTERVAL):
            with self._lock:
                if self._paused:
                    continue
                for slot in self.slots:
                    try:
                        self._check(slot, time.monotonic())
                    except Exception:  # noqa: BLE001 - Redis away, say: the next pass tries again
                        log.warning("supervising local worker %s failed", slot.name, exc_info=True)

    def _check(self, slot: WorkerSlot, now: float) -> None:
        if slot.restart_at is not None:
            if now >= slot.restart_at:
                self._restart(slot, now)
        elif not slot.process.alive():
            self._lost(slot, now)
        elif slot.replaced is not None and self.connection.exists(f"rq:worker:{slot.name}"):
            self._unregister(slot.replaced)
            slot.replaced = None

    def _lost(self, slot: WorkerSlot, now: float) -> None:
        code = slot.process.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        if now - slot.started >= HEALTHY_AFTER:
            slot.delay = RESTART_FIRST_DELAY
        slot.restart_at = now + slot.delay
        log.warning("local worker %s stopped (%s); starting another in %.0f s. Its last lines:\n%s",
                    slot.name, how, slot.delay, slot.process.tail(10))
        print(f"rqllm serve: local worker {slot.name} stopped ({how}); starting another in {slot.delay:.0f} s",
              file=sys.stderr, flush=True)
        slot.delay = min(slot.delay * 2, RESTART_MAX_DELAY)
        slot.process.close()
        ended = end_lost_job(self.connection, slot.name, how)
        if ended is not None:
            log.warning("job %s of worker %s: %s", ended[0], slot.name, ended[1])

    def _restart(self, slot: WorkerSlot, now: float) -> None:
        slot.generation += 1
        old, slot.replaced = slot.process, slot.replaced or slot.name
        slot.name = f"{slot.base_name}.{slot.generation}"  # a new name: the dead one's stays registered a while
        slot.process = self.spawn(slot.model, slot.name)
        slot.started, slot.restart_at = now, None
        self.restarts += 1
        self.on_replace(old, slot.process)

    def _unregister(self, name: str) -> None:
        from rq import SimpleWorker, worker_registration

        from jobs.redis_conn import SERIALIZER

        worker = SimpleWorker.find_by_key(f"rq:worker:{name}", connection=self.connection, serializer=SERIALIZER)
        if worker is not None:
            worker_registration.unregister(worker)
            self.connection.delete(worker.key)

    def pause(self) -> None:
        """No more restarts (shutdown); returns once a pass in progress is over."""
        with self._lock:
            self._paused = True

    def finish(self) -> None:
        self._exit.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(5)


@dataclass
class LocalProcesses:
    redis: RedisServer | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    supervisor: WorkerSupervisor | None = None

    def stop(self) -> None:
        try:
            if self.supervisor is not None:
                self.supervisor.pause()
            stop_workers(self.workers, grace=WORKER_STOP_GRACE)
        finally:
            if self.supervisor is not None:
                self.supervisor.finish()  # after the workers: restarted ones die with this thread
            if self.redis is not None:
                self.redis.stop()


def start_local(*, redis_url: str | None, data_dir: str, models: list[str],
                workers: int, threads: int | None, kv_budget: str | None, repack: bool) -> tuple[str, LocalProcesses]:
    """The Redis URL to serve and the processes this server started (stopped by the caller); local workers
    are supervised (restarted when they die)."""
    local = LocalProcesses()
    try:
        if redis_url is None:
            local.redis = RedisServer(data_dir=os.path.join(data_dir, "redis"), die_with_parent=True).start()
            redis_url = local.redis.url
        if workers > 0:
            log_dir = os.path.join(data_dir, "logs")
            os.makedirs(log_dir, exist_ok=True)
            per_worker = threads or choose_threads(workers=workers * len(models)).threads
            url = redis_url

            def spawn(model: str, name: str) -> WorkerProcess:
                cmd = worker_argv(url, model, threads=per_worker, kv_budget=kv_budget, name=name, repack=repack)
                return WorkerProcess(cmd, os.path.join(log_dir, f"{name}.log"), die_with_parent=True)

            slots = []
            for model in models:
                for i in range(workers):
                    name = f"serve-{os.getpid()}-{model}-{i}".replace("/", "_")
                    slots.append(WorkerSlot(model, name, spawn(model, name)))
                    local.workers.append(slots[-1].process)

            def replace(old: WorkerProcess, new: WorkerProcess) -> None:
                local.workers[:] = [new if w is old else w for w in local.workers]

            local.supervisor = WorkerSupervisor(redis_url, slots, spawn, on_replace=replace)
            local.supervisor.start()
    except BaseException:
        local.stop()
        raise
    return redis_url, local


def run(config: ServeConfig, *, host: str, port: int, local: LocalProcesses, log_level: str = "info") -> None:
    import uvicorn

    from pipeline.api.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"rqllm serve: http://{host}:{port}/v1 (queue {config.redis_url.split('@')[-1]}, "
          f"{len(local.workers)} local worker(s), data in {config.data_dir}, "
          f"{'%d API key(s)' % len(config.api_keys) if config.api_keys else 'no API key'})", file=sys.stderr,
          flush=True)
    # uvicorn handles SIGINT/SIGTERM itself, then raises the signal again under the handlers it found: with
    # the default ones that kills this process before it stops its workers and Redis. Found handlers that
    # do nothing, the shutdown below runs.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    try:
        uvicorn.run(create_app(config), host=host, port=port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        local.stop()
