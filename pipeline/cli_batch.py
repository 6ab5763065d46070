"""CLI commands on one batch's jobs: jobs (list them with their states) and cancel."""
from __future__ import annotations

import click

from pipeline.cli_jobs import _client, _echo_err
from pipeline.cli_options import redis_url_option


@click.command("jobs")
@click.argument("batch_id")
@redis_url_option()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def jobs_command(batch_id: str, redis_url: str | None, as_json: bool) -> None:
    """List BATCH_ID's lines: job id, state and custom_id (for `rqllm watch JOB_ID` while a job runs).

    States: queued, started, deferred (waits for other jobs), done, failed (with its error), refused
    (at submission: no job)."""
    from pipeline.batch_view import job_states

    client = _client(redis_url)
    try:
        client.batch_status(batch_id)
    except KeyError as e:
        raise click.ClickException(str(e).strip("'\"")) from None
    states = job_states(client, batch_id)
    if as_json:
        for st in states:
            click.echo(st.model_dump_json())
        return
    width = max((len(st.job_id or "-") for st in states), default=1)
    for st in states:
        click.echo(f"{st.job_id or '-':<{width}}  {st.state:<9}  {st.custom_id if st.custom_id is not None else '-'}"
                   + (f"  {st.error}" if st.error else ""))
    counts: dict[str, int] = {}
    for st in states:
        counts[st.state] = counts.get(st.state, 0) + 1
    _echo_err(f"{batch_id}: {len(states)} line(s): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


@click.command("cancel")
@click.argument("batch_id")
@redis_url_option()
def cancel_command(batch_id: str, redis_url: str | None) -> None:
    """Cancel BATCH_ID: its queued jobs never run, its running ones stop between two tokens.

    Each cancelled job is recorded failed (batch_cancelled), so `rqllm collect` writes its line; finished
    lines are kept. A job another batch (or an API request) also waits for is left running for it."""
    from pipeline.batch_view import cancel_batch

    client = _client(redis_url)
    try:
        status = client.batch_status(batch_id)
    except KeyError as e:
        raise click.ClickException(str(e).strip("'\"")) from None
    if status.metadata.get("api"):
        # the API server's runner makes its output and error files when it cancels: it must do it
        raise click.ClickException(f"{batch_id} was created through the API: cancel it there "
                                   f"(POST /v1/batches/{batch_id}/cancel), which also writes its files")
    outcomes = cancel_batch(client, batch_id, message="the batch was cancelled (rqllm cancel) before this request "
                                                     "finished")
    words = {"cancelled": "cancelled before they ran", "stopping": "stopping (were running)",
             "shared": "left to another batch waiting for them", "ended": "had ended already",
             "gone": "no longer in Redis"}
    click.echo(f"{batch_id}: " + (", ".join(f"{n} job(s) {words.get(k, k)}" for k, n in sorted(outcomes.items()))
                                  or "no jobs"))


COMMANDS: list[click.Command] = [jobs_command, cancel_command]
