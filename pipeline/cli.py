"""The `rqllm` command. Subcommands live in small modules and register themselves here."""
from __future__ import annotations

import click


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        from jobs.redis_conn import REDIS_DOWN_ERRORS, RedisRefused, RedisUnreachable

        try:
            return super().invoke(ctx)
        except (RedisRefused, RedisUnreachable) as e:  # a wrong password, no Redis there: one line, not a traceback
            raise click.ClickException(str(e)) from None
        except REDIS_DOWN_ERRORS as e:  # Redis went away mid-command and stayed away past the client's retries
            raise click.ClickException(f"lost Redis: {' '.join(str(e).split())}") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rqllm")
def main() -> None:
    """Batch LLM inference on CPUs: jobs in Redis (rq), workers running a GGUF engine."""


def _register() -> None:
    # Engine-side commands: models, generate, tokenize.
    from pipeline import cli_engine
    # Queue-side commands: submit, collect, watch, status; a batch's jobs, cancel.
    from pipeline import cli_batch, cli_jobs
    # The worker: worker.
    from pipeline import cli_worker
    # The OpenAI-compatible HTTP API: serve.
    from pipeline import cli_serve
    # Bulk summarisation: summarize.
    from pipeline import cli_summarize
    # Bulk extraction under a JSON schema: extract.
    from pipeline import cli_extract

    for module in (cli_engine, cli_jobs, cli_batch, cli_worker, cli_summarize, cli_extract, cli_serve):
        for command in module.COMMANDS:
            main.add_command(command)


_register()
