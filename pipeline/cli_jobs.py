"""CLI commands for the queue: submit, collect, watch, status (a batch's jobs and cancel: pipeline.cli_batch;
the worker: pipeline.cli_worker).

With REDIS_URL set, commands talk to that Redis (submit only submits; collect/--wait follow).
Without it, `rqllm submit ... --wait` runs an embedded cluster (private redis-server + worker
processes) for the duration of the command.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from engine.defaults import DEFAULT_MODEL
from jobs.defaults import DEFAULT_PRIORITY, JOB_TIMEOUT, PRIORITIES
from pipeline.cli_options import (json_schema_options, kv_budget_option, no_repack_option, redis_url_option,
                                  response_format_option, sampling_options, threads_option, workers_option)


def _echo_err(msg: str) -> None:
    click.echo(msg, err=True)


def _client(redis_url: str | None):
    """A Client for --redis-url / REDIS_URL; a Redis that is not there is one line within seconds
    (jobs.redis_conn.reachable), not a traceback after the client's retries."""
    from pipeline.client import Client
    from jobs.redis_conn import reachable, redis_url_from_env

    url = redis_url or redis_url_from_env()
    if not url:
        raise click.UsageError("set REDIS_URL (or --redis-url) to reach the queue")
    return Client(connection=reachable(url))


def _gather_jobs(inputs: tuple[str, ...], *, model: str | None, literal: bool, raw: bool, system: str | None,
                 params: dict[str, Any], check_model: Any = None) -> tuple[list[Any], list[Any]]:
    """Jobs from arguments: .jsonl files (OpenAI Batch input), other files (one prompt each), literals;
    and the refused ones (pipeline.batch_file.Refused, which the batch keeps as error lines).
    check_model (pipeline.model_check.ModelCheck): a job naming a model it refuses is refused (model_not_found)."""
    from jobs.schemas import InvalidJob, validate_job
    from pipeline.batch_file import INVALID_REQUEST, MODEL_NOT_FOUND, Refused, read_batch_file

    jobs: list[Any] = []
    errors: list[Refused] = []
    n_literal = 0

    def prompt_job(text: str, custom_id: str) -> None:
        data: dict[str, Any] = {"model": model or DEFAULT_MODEL, "custom_id": custom_id, "params": params}
        why = check_model(data["model"]) if check_model is not None else None
        if why is not None:
            errors.append(Refused(custom_id, MODEL_NOT_FOUND, why, param="model"))
            return
        if raw:
            data["prompt"] = text
        else:
            msgs = [{"role": "system", "content": system}] if system else []
            data["messages"] = msgs + [{"role": "user", "content": text}]
        try:
            jobs.append(validate_job(data))
        except InvalidJob as e:
            errors.append(Refused(custom_id, INVALID_REQUEST, str(e), param=e.param))

    for arg in inputs:
        path = Path(arg)
        if not literal and path.is_file():
            if path.suffix.lower() == ".jsonl":
                file_jobs, line_errors = read_batch_file(path, model=model, default_model=DEFAULT_MODEL,
                                                         check_model=check_model)
                for g in file_jobs:
                    if params:
                        merged = {**g.params.model_dump(exclude_unset=True), **params}
                        try:
                            g = validate_job({**g.model_dump(exclude={"id", "params"}), "params": merged})
                        except InvalidJob as e:
                            errors.append(Refused(g.custom_id, INVALID_REQUEST, str(e), file=str(path), param=e.param))
                            continue
                    jobs.append(g)
                errors.extend(Refused.from_line_error(e, file=str(path)) for e in line_errors)
            else:
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    errors.append(Refused(str(path), INVALID_REQUEST,
                                          f"not UTF-8 text ({e.reason} at byte {e.start}); not submitted"))
                    continue
                prompt_job(text, str(path))
        else:
            n_literal += 1
            prompt_job(arg, f"prompt-{n_literal}")
    return jobs, errors


@click.command("submit")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--model", "-m", default=None, help=f"Model for every job (default: body.model, else {DEFAULT_MODEL}).")
@click.option("--priority", type=click.Choice(PRIORITIES), default=DEFAULT_PRIORITY, show_default=True)
@click.option("--timeout", type=int, default=None, help=f"Per-job timeout in seconds (default {JOB_TIMEOUT}).")
@click.option("--retries", type=int, default=0, show_default=True, help="Retries for jobs that fail in a worker.")
@click.option("--recompute", is_flag=True, help="Generate again even when a finished result exists.")
@click.option("--wait", "wait", is_flag=True, help="Collect the results in this command.")
@click.option("-o", "--output", default=None, help="Write OpenAI Batch output JSONL here (implies --wait).")
@sampling_options("max_tokens", "temperature", "top_p", "seed", "stop", defaults=False)
@json_schema_options("every output")
@click.option("--raw", is_flag=True, help="Prompts are raw completions (no chat template).")
@click.option("--system", default=None, help="System message for prompt arguments / text files.")
@click.option("--literal", is_flag=True, help="Treat every argument as prompt text, even if a file exists.")
@workers_option(help="Embedded mode: worker processes (default: one per usable CPU, at most one per job and as "
                    "many as memory holds; the rest of the CPUs become threads).")
@threads_option(help="Embedded mode: engine threads per worker (default: $RQLLM_THREADS, else usable CPUs / "
                     "workers).")
@kv_budget_option(help="Embedded mode: KV budget per worker.")
@redis_url_option()
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@no_repack_option(help="Embedded mode: workers compute on the GGUF's own layout (no repacked weight cache).")
def submit_command(inputs: tuple[str, ...], model: str | None, priority: str, timeout: int | None, retries: int,
                   recompute: bool, wait: bool, output: str | None, sampling: dict[str, Any],
                   json_schema: str | None, json_object: bool, raw: bool, system: str | None, literal: bool,
                   workers: int, threads: int | None,
                   kv_budget: str | None, redis_url: str | None, no_progress: bool, no_repack: bool) -> None:
    """Submit prompts (arguments), text files (one job each) or OpenAI Batch .jsonl files; print the batch id.

    A refused line (bad JSON, a bad field, an unknown model) is said on stderr, and kept with the batch
    as an error line with its custom_id (what `rqllm collect` writes); the rest is submitted, and the
    command then exits 1, saying how many lines were refused."""
    from jobs.schemas import InvalidJob, model_key
    from pipeline.client import Client
    from pipeline.model_check import ModelCheck
    from pipeline.collector import collect

    params: dict[str, Any] = dict(sampling)  # only the flags given: the rest stay as each batch line says
    response_format = response_format_option(json_schema, json_object, None)
    if response_format is not None:
        params["response_format"] = response_format
    # a model no live worker of REDIS_URL holds, that the registry does not know and that is no .gguf file
    # here is refused now: its jobs would wait on a queue nobody serves
    remote = _client(redis_url) if redis_url else None
    check = ModelCheck.live(remote, files=True)
    jobs, errors = _gather_jobs(inputs, model=model, literal=literal, raw=raw, system=system, params=params,
                                check_model=check)
    if not jobs and len(errors) <= 1:  # one line, as `generate` and `worker` say a bad model
        raise click.ClickException("nothing to submit" + (f": {errors[0]}" if errors else ""))
    for e in errors:
        _echo_err(f"refused: {e}")
    if not jobs:
        raise click.ClickException(f"nothing to submit: all {len(errors)} lines were refused")
    wait = wait or output is not None
    if not redis_url and not wait:
        raise click.UsageError("no REDIS_URL: use --wait/-o to run an embedded cluster for this command, "
                               "or set REDIS_URL to submit to a running one")
    out = output or "-"

    def run(client: Client, health=None) -> None:
        try:
            batch_id = client.submit_batch(jobs, priority=priority, timeout=timeout, retries=retries,
                                           recompute=recompute, refused=errors)
        except InvalidJob as e:
            raise click.ClickException(str(e)) from None
        rep = client.last_report
        click.echo(batch_id, err=(out == "-" and wait))
        if rep is not None:
            _echo_err(f"{batch_id}: {rep.requests} request(s), {rep.total} job(s): {rep.enqueued} enqueued, "
                      f"{rep.joined} already queued, {rep.cached} finished earlier")
        if wait:
            s = collect(client, batch_id, out, progress=not no_progress, health=health)
            _echo_err(f"{batch_id}: {s.done} done, {s.failed} failed, {s.written} line(s) written"
                      + (f" to {output}" if output else "") + f" in {s.seconds:.1f} s")
        if errors:  # submitted, but not all of it: say how much was left out, and exit non-zero
            _echo_err(f"{batch_id}: {len(errors)} line(s) refused; each is an error line with its custom_id in "
                      "the batch's results")

    def finish() -> None:
        if errors:
            raise SystemExit(1)

    if remote is not None:
        run(remote)
        finish()
        return
    from pipeline.embedded import choose_embedded_split, embedded_cluster
    from pipeline.model_check import model_file_problem

    models = {model_key(j.model) for j in jobs}
    if len(models) != 1:
        raise click.UsageError(f"embedded mode runs one model; these jobs name {', '.join(sorted(models))}")
    # the workers' own start-up check, before any process starts: one line, not their exits
    problem = model_file_problem(jobs[0].model, kv_budget)
    if problem is not None:
        raise click.ClickException(problem)
    split = choose_embedded_split(jobs[0].model, len(jobs), workers=workers, threads=threads, kv_budget=kv_budget,
                                  repack=not no_repack)
    with embedded_cluster(jobs[0].model, workers=split.workers, threads=split.threads, kv_budget=kv_budget,
                          repack=not no_repack, split_reason=split.reason) as cluster:
        _echo_err(f"embedded cluster: redis {cluster.server.address}, {cluster.split}")
        run(Client(cluster.redis_url), health=cluster.check)
    finish()


@click.command("collect")
@click.argument("batch_id")
@click.option("-o", "--output", default="-", show_default=True, help="Output JSONL (resumable); - for stdout.")
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds.")
@redis_url_option()
@click.option("--no-progress", is_flag=True)
def collect_command(batch_id: str, output: str, timeout: float | None, redis_url: str | None,
                    no_progress: bool) -> None:
    """Follow BATCH_ID until every job has ended, writing one OpenAI Batch output line per request."""
    from pipeline.collector import collect

    client = _client(redis_url)
    try:
        s = collect(client, batch_id, output, progress=not no_progress, timeout=timeout)
    except KeyError as e:
        raise click.ClickException(str(e).strip("'\"")) from None
    except TimeoutError as e:
        raise click.ClickException(str(e)) from None
    _echo_err(f"{batch_id}: {s.written} new line(s), {s.already} already written; "
              f"{s.done} done, {s.failed} failed in {s.seconds:.1f} s"
              + (f"; {s.refused} of the {s.requests} line(s) were refused at submission" if s.refused else ""))


@click.command("watch")
@click.argument("job_id")
@redis_url_option()
@click.option("--timeout", type=float, default=None, help="Give up waiting after this many seconds.")
def watch_command(job_id: str, redis_url: str | None, timeout: float | None) -> None:
    """Print a job's tokens live (waits if it has not started; replays if it has finished)."""
    from jobs.streams import follow_tokens

    client = _client(redis_url)
    t0 = time.monotonic()

    def idle() -> bool:
        if timeout is not None and time.monotonic() - t0 > timeout:
            raise click.ClickException(f"no end of job {job_id} after {timeout} s")
        if client.job_status(job_id) is None and client.result(job_id) is None:
            # Neither queued nor finished: unknown id, or the stream expired.
            from jobs import keys

            if not client.connection.exists(keys.token_stream_key(job_id)):
                raise click.ClickException(f"unknown job {job_id}")
        return True

    res = None
    started = False
    for e in follow_tokens(client.connection, job_id, idle=idle):
        if e.type == "start":
            if started:
                # Text already printed cannot be taken back: mark it on stdout too, so piped output
                # says which part the final result no longer contains.
                note = "[restarted: attempt %s on %s; the text above was discarded]" % (
                    e.data.get("attempt"), e.data.get("worker"))
                sys.stdout.write("\n" + note + "\n")
                sys.stdout.flush()
                click.echo(note, err=True)
            started = True
        elif e.type == "text":
            sys.stdout.write(str(e.data.get("text", "")))
            sys.stdout.flush()
        elif e.type == "interrupted":
            click.echo("\n[interrupted: the job was put back on its queue]", err=True)
        elif e.type == "end":
            res = e.data
    if not started:
        # Stream expired but the result is kept longer.
        r = client.result(job_id)
        if r is not None:
            sys.stdout.write(r.text)
            res = {"status": r.status, "finish_reason": r.finish_reason,
                   "error": r.error.model_dump() if r.error else None}
    sys.stdout.write("\n")
    if res is not None:
        if res.get("status") == "failed":
            err = res.get("error") or {}
            click.echo(f"[failed: {err.get('code')}: {err.get('message')}]", err=True)
            sys.exit(1)
        click.echo(f"[done: {res.get('finish_reason')}]", err=True)


@click.command("status")
@redis_url_option()
@click.option("--limit", type=int, default=10, show_default=True, help="Most recent batches to show.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_command(redis_url: str | None, limit: int, as_json: bool) -> None:
    """Queues (queued/started/failed), workers (model, current job), recent batches with counts.

    A batch's counts are of its input lines, as the API's request_counts are: refused lines count
    as failed; lines with the same content share one job (its "jobs")."""
    from pipeline.batch_view import line_counts

    client = _client(redis_url)
    queues = [{"name": q.name, "queued": q.count, "started": q.started_job_registry.count,
               "failed": q.failed_job_registry.count} for q in client.queues()]
    workers = client.workers()
    batches = []
    for b in client.list_batches(limit):
        # lines, as the API's request_counts count them (refused ones too); jobs: distinct contents run
        lines = line_counts(client, b)
        batches.append({"batch_id": b.batch_id, "created": b.created, "requests": lines.lines, "done": lines.done,
                        "failed": lines.failed, "refused": lines.refused, "pending": lines.pending, "jobs": b.total,
                        "jobs_done": b.done, "jobs_failed": b.failed, "cached": b.cached, "models": b.models,
                        "priority": b.priority, "cancelled": b.cancelled is not None})
    if as_json:
        click.echo(json.dumps({"queues": queues, "workers": workers, "batches": batches}, indent=2))
        return
    click.echo("QUEUES")
    if not queues:
        click.echo("  (none)")
    for q in queues:
        click.echo(f"  {q['name']:<40} queued {q['queued']:>6}  started {q['started']:>3}  failed {q['failed']:>5}")
    click.echo("WORKERS")
    if not workers:
        click.echo("  (none)")
    for w in workers:
        click.echo(f"  {w['name']:<40} {w['state']:<8} model {w['model'] or '?':<16} "
                   f"job {w['current_job'] or '-'}  ok {w['successful']} failed {w['failed']}")
    click.echo("BATCHES")
    if not batches:
        click.echo("  (none)")
    for b in batches:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created"]))
        refused = f" ({b['refused']} refused)" if b["refused"] else ""
        click.echo(f"  {b['batch_id']}  {when}  {b['done']}/{b['requests']} done, {b['failed']} failed{refused}, "
                   f"{b['pending']} pending ({b['jobs']} jobs, {b['cached']} reused) "
                   f"{','.join(b['models'])} [{b['priority']}]" + (" cancelled" if b["cancelled"] else ""))


COMMANDS: list[click.Command] = [submit_command, collect_command, watch_command, status_command]
