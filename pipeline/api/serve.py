"""Process set-up for `rqllm serve`: the queue (REDIS_URL, or an embedded redis-server keeping its data
in the data directory), optional local workers, then uvicorn until SIGINT/SIGTERM.

Embedded mode gives a working server on a fresh machine with one command. Its redis-server keeps an
append-only file under <data dir>/redis, so a restarted server finds its files, batches and queued
jobs again; its children get SIGTERM when the server dies, even by SIGKILL (pipeline.embedded).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass, field

from engine.cpus import choose_threads
from pipeline.api.auth import is_loopback
from pipeline.api.config import ServeConfig
from pipeline.embedded import RedisServer, WorkerProcess, stop_workers, worker_argv

WORKER_STOP_GRACE = 10.0  # seconds for a worker to finish its job at shutdown before it is told to stop now


class ServeError(RuntimeError):
    pass


def check_exposure(host: str, config: ServeConfig) -> None:
    """No key means loopback only, unless the operator says otherwise."""
    if not config.api_keys and not config.insecure_no_auth and not is_loopback(host):
        raise ServeError(f"no API key configured: refusing to listen on {host} (reachable from other hosts). "
                         "Give --api-key / RQLLM_API_KEYS, listen on 127.0.0.1, or pass --insecure-no-auth.")


@dataclass
class LocalProcesses:
    redis: RedisServer | None = None
    workers: list[WorkerProcess] = field(default_factory=list)

    def stop(self) -> None:
        try:
            stop_workers(self.workers, grace=WORKER_STOP_GRACE)
        finally:
            if self.redis is not None:
                self.redis.stop()


def start_local(*, redis_url: str | None, data_dir: str, models: list[str],
                workers: int, threads: int | None, kv_budget: str | None, repack: bool) -> tuple[str, LocalProcesses]:
    """The Redis URL to serve and the processes this server started (stopped by the caller)."""
    local = LocalProcesses()
    try:
        if redis_url is None:
            local.redis = RedisServer(data_dir=os.path.join(data_dir, "redis"), die_with_parent=True).start()
            redis_url = local.redis.url
        if workers > 0:
            log_dir = os.path.join(data_dir, "logs")
            os.makedirs(log_dir, exist_ok=True)
            per_worker = threads or choose_threads(workers=workers * len(models)).threads
            for model in models:
                for i in range(workers):
                    name = f"serve-{os.getpid()}-{model}-{i}".replace("/", "_")
                    cmd = worker_argv(redis_url, model, threads=per_worker, kv_budget=kv_budget, name=name,
                                         repack=repack)
                    local.workers.append(WorkerProcess(cmd, os.path.join(log_dir, f"{name}.log"),
                                                       die_with_parent=True))
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
