"""CLI command that runs a worker: `rqllm worker` (also `python -m pipeline.cli_worker`, what embedded
clusters start)."""
from __future__ import annotations

import sys

import click

from engine.cpus import ThreadSettingError, choose_threads
from engine.defaults import DEFAULT_MODEL
from engine.registry import KNOWN_MODELS
from pipeline.cli_options import (kv_budget_option, kv_type_option, no_repack_option, redis_url_option,
                                  speculation_mode, speculation_options, threads_option)
from pipeline.memory_guard import check_worker_start, no_memory_check_option
from pipeline.recovery import DEFAULT_HEARTBEAT_GRACE, DEFAULT_HEARTBEAT_INTERVAL
from pipeline.worker import DEFAULT_MAINTENANCE_INTERVAL, run_worker


@click.command("worker")
@click.option("--model", "-m", required=True,
              help=f"A known model ({', '.join(sorted(KNOWN_MODELS))}; default for jobs that name none: "
                   f"{DEFAULT_MODEL}) or a .gguf path.")
@threads_option(help="Engine threads (default: $RQLLM_THREADS, else the CPUs this process may use: affinity mask "
                    "and cgroup CPU quota).")
@kv_budget_option(help="KV cache budget, e.g. 256MiB.")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--name", default=None, help="Worker name (default <model>.<host>.<pid>).")
@redis_url_option(help="Redis URL (default $REDIS_URL, else redis://127.0.0.1:6379/0; $REDIS_URL is the better "
                      "place for one with a password: a password given here is moved there at start, out of the "
                      "command line that `ps` shows).")
@click.option("--max-jobs", type=int, default=None, help="Exit after this many jobs.")
@click.option("--heartbeat-interval", type=int, default=DEFAULT_HEARTBEAT_INTERVAL, show_default=True)
@click.option("--heartbeat-grace", type=int, default=DEFAULT_HEARTBEAT_GRACE, show_default=True,
              help="Seconds after the last heartbeat before a job counts as abandoned.")
@click.option("--maintenance-interval", type=int, default=DEFAULT_MAINTENANCE_INTERVAL, show_default=True,
              help="Seconds between rq's registry cleanups (a dead worker's job is found within "
                   "heartbeat interval + grace + 5 s regardless).")
@click.option("--log-level", default="INFO", show_default=True,
              help="INFO: one line per job (tokens in and out, tok/s); DEBUG adds rq's own lines.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), envvar="RQLLM_METRICS_PORT", default=None,
              help="Serve Prometheus metrics on this port (/metrics; /ready answers 200 once ready, else 503). "
                   "Default $RQLLM_METRICS_PORT, else none.")
@click.option("--metrics-addr", envvar="RQLLM_METRICS_ADDR", default="127.0.0.1", show_default=True,
              help="Address the metrics port listens on (0.0.0.0 in a container, for Prometheus to reach it).")
@click.option("--ready-file", envvar="RQLLM_READY_FILE", default=None, type=click.Path(dir_okay=False),
              help="A file that exists only while the worker is ready: its model loaded, Redis reachable "
                   "(`test -f FILE` as a healthcheck or readiness probe). Default $RQLLM_READY_FILE.")
@no_memory_check_option
@no_repack_option
@kv_type_option
@speculation_options
def worker_command(model: str, threads: int | None, kv_budget: str | None, burst: bool, name: str | None,
                   redis_url: str | None, max_jobs: int | None, heartbeat_interval: int, heartbeat_grace: int,
                   maintenance_interval: int, log_level: str, metrics_port: int | None, metrics_addr: str,
                   ready_file: str | None, no_repack: bool, prompt_lookup: bool, draft: str | None) -> None:
    """Run one worker process for MODEL: load the engine once, generate queued jobs one at a time.

    --prompt-lookup / --draft MODEL: jobs that leave params.speculative unset decode speculatively
    (with both, prompt lookup is the default and jobs may ask for the draft model).

    Redis unreachable: at start (and whenever it goes away later) the worker prints "waiting for
    Redis at <address>" with the reason, and tries again with backoff (1 s, 2 s, 4 s ... up to
    30 s) until it answers; it never exits for that. A wrong password is an error at once."""
    from pipeline.processes import die_with_parent_from_env, move_redis_url_to_env

    die_with_parent_from_env()  # started by an rqllm command: stop when it does
    move_redis_url_to_env(redis_url)
    try:
        thread_choice = choose_threads(threads)
    except ThreadSettingError as e:
        raise click.UsageError(str(e)) from None
    repack = False if no_repack else None
    # a bad model file or not enough memory: say so before loading
    check_worker_start(model, kv_budget, repack=repack, draft=draft)
    run_worker(model, redis_url=redis_url, threads=thread_choice, kv_budget=kv_budget, burst=burst, name=name,
               max_jobs=max_jobs, heartbeat_interval=heartbeat_interval, heartbeat_grace=heartbeat_grace,
               maintenance_interval=maintenance_interval, logging_level=log_level.upper(), repack=repack,
               draft=draft, speculative=speculation_mode(prompt_lookup, draft), metrics_port=metrics_port,
               metrics_addr=metrics_addr, ready_file=ready_file)



COMMANDS: list[click.Command] = [worker_command]


if __name__ == "__main__":
    sys.exit(worker_command(prog_name="rqllm worker"))
