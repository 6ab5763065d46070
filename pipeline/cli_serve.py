"""CLI command for the OpenAI-compatible HTTP API: serve."""
from __future__ import annotations

import click

from pipeline.api.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_FILE_REQUESTS,
    KEYS_ENV,
)
from engine.defaults import DEFAULT_MODEL
from pipeline.cli_options import (kv_budget_option, no_repack_option, redis_url_option, threads_option,
                                  workers_option)


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--model", "-m", "models", multiple=True,
              help=f"Model(s) for local workers (repeatable); the first is the default for requests naming none "
                   f"(default {DEFAULT_MODEL}).")
@workers_option(help="Local worker processes per model (default: 1 without REDIS_URL, 0 with it).", min_workers=0)
@threads_option(help="Engine threads per local worker (default: usable CPUs / workers).")
@kv_budget_option(help="Local workers' KV budget, e.g. 256MiB.")
@no_repack_option(help="Local workers compute on the GGUF's own layout.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where files, batch working files and the embedded Redis live (default <cache>/api).")
@click.option("--api-key", "api_keys", multiple=True,
              help=f"Accepted API key (repeatable; also ${KEYS_ENV}, comma-separated). Each key owns its files and "
                   "batches.")
@click.option("--insecure-no-auth", is_flag=True, help="Without keys, serve non-loopback clients too.")
@click.option("--max-file-bytes", type=click.IntRange(1), default=DEFAULT_MAX_FILE_BYTES, show_default=True)
@click.option("--max-file-requests", type=click.IntRange(1), default=DEFAULT_MAX_FILE_REQUESTS, show_default=True)
@click.option("--max-body-bytes", type=click.IntRange(1), default=DEFAULT_MAX_BODY_BYTES, show_default=True,
              help="Largest request body other than a file upload (413 above).")
@click.option("--job-timeout", type=click.IntRange(1), default=None, help="Per-job timeout in seconds.")
@click.option("--retries", type=click.IntRange(0), default=0, show_default=True,
              help="Retries for batch jobs that fail in a worker.")
@redis_url_option(help="Serve this queue (default $REDIS_URL); unset = an embedded Redis keeping its data in "
                      "--data-dir.")
@click.option("--log-level", default="info", show_default=True)
def serve_command(host: str, port: int, models: tuple[str, ...], workers: int | None, threads: int | None,
                  kv_budget: str | None, no_repack: bool, data_dir: str | None, api_keys: tuple[str, ...],
                  insecure_no_auth: bool, max_file_bytes: int, max_file_requests: int, max_body_bytes: int,
                  job_timeout: int | None, retries: int, redis_url: str | None, log_level: str) -> None:
    """An OpenAI-compatible API (Files, Batches, chat/completions, models) in front of the queue."""
    from pipeline.api import serve
    from pipeline.api.config import ServeConfig, config_error, default_data_dir, keys_from_env
    from pipeline.embedded import EmbeddedError
    from pipeline.processes import move_redis_url_to_env

    move_redis_url_to_env(redis_url)  # a password on the command line: into REDIS_URL, out of `ps`
    model_list = list(models) or [DEFAULT_MODEL]
    keys = list(api_keys) + keys_from_env()
    directory = data_dir or str(default_data_dir())
    settings = dict(data_dir=directory, api_keys=keys, insecure_no_auth=insecure_no_auth,
                    default_model=model_list[0], max_file_bytes=max_file_bytes, max_file_requests=max_file_requests,
                    max_body_bytes=max_body_bytes, job_timeout=job_timeout, batch_retries=retries)
    try:
        checked = ServeConfig(redis_url=redis_url or "redis://", **settings)
    except ValueError as e:  # a blank --api-key, a placeholder password in REDIS_URL, a bad limit
        raise click.ClickException(config_error(e)) from None
    try:
        serve.check_exposure(host, checked)
        n_workers = workers if workers is not None else (0 if redis_url else 1)
        url, local = serve.start_local(redis_url=redis_url or None, data_dir=directory, models=model_list,
                                       workers=n_workers, threads=threads, kv_budget=kv_budget,
                                       repack=not no_repack)
    except (serve.ServeError, EmbeddedError) as e:
        raise click.ClickException(str(e)) from None
    serve.run(ServeConfig(redis_url=url, **settings), host=host, port=port, local=local, log_level=log_level)


COMMANDS: list[click.Command] = [serve_command]
