"""The run: collect the documents, plan each one, submit its map and reduce jobs as one batch through
pipeline.client.Client (the one enqueue path: ledger claims, doorbell), follow the batch's events
and write the summaries. With no REDIS_URL it all happens inside pipeline.embedded's private cluster
(redis-server + --workers worker processes, stopped at the end); with REDIS_URL the command only
submits and follows, and the workers are whoever serves that Redis. The batch shows in `rqllm status`.
"""
from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from engine.defaults import DEFAULT_KV_BUDGET, DEFAULT_MODEL
from jobs.defaults import DEFAULT_PRIORITY, JOB_TIMEOUT
from jobs.redis_conn import connect, reachable, redis_url_from_env
from jobs.schemas import GenerationJob, model_key
from jobs.summary_unit import part_label_pattern
from pipeline.client import Client
from pipeline.defaults import RUN_RESULT_TTL, RUN_STREAM_TTL
from pipeline.model_check import ModelCheck, model_file_problem
from pipeline.model_header import cached_header, live_kv_tokens
from pipeline.embedded import choose_embedded_split, embedded_cluster
from pipeline.enqueue import TaskCall
from pipeline.summarize.documents import DEFAULT_MAX_BYTES, collect_documents
from pipeline.summarize.errors import SummarizeError
from pipeline.summarize.follow import DocState, cancel_rest, follow
from pipeline.summarize.plan import (DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_SUMMARY_TOKENS, DEFAULT_OVERLAP_TOKENS,
                                     TOKENS_RE, Budget, DocPlan, PromptMeter, kv_capacity, plan_document,
                                     reduce_fan_in, worker_kv_budget)
from pipeline.summarize.report import Output, Progress, RunReport
from pipeline.summarize.templates import DEFAULT_STYLE, Templates, document_context, words_for

if TYPE_CHECKING:
    from engine.model_info import ModelInfo

TASK_MAP = "jobs.summarize_tasks.summarize_chunk"
TASK_REDUCE = "jobs.summarize_tasks.reduce_summaries"
# Map and reduce jobs guess tokens by prompt lookup: summaries copy phrases from their input, and
# greedy output is the same either way (bench/bench_speculative.py measures the gain).
DEFAULT_SPECULATIVE = "prompt_lookup"
JOB_RETRIES = 1


def submit_plans(client: Client, batch_id: str, plans: Sequence[DocPlan], *, model: str, templates: Templates,
                 budget: Budget, priority: str = DEFAULT_PRIORITY, seed: int | None = None,
                 speculative: str = DEFAULT_SPECULATIVE) -> None:
    """Add every map job, then the reduce jobs (deferred until their inputs finish), to the batch.
    speculative: the jobs' params.speculative (engine.params.SpeculativeMode)."""
    words = words_for(budget.max_summary_tokens)
    params = {"max_tokens": budget.max_summary_tokens, "temperature": 0.0, "repetition_penalty": 1.1,
              "speculative": speculative}
    if seed is not None:
        params["seed"] = seed
    calls: list[TaskCall] = []
    for plan in plans:
        for chunk, job_id, messages in zip(plan.chunks, plan.map_ids, plan.map_messages):
            gjob = GenerationJob(model=model, messages=messages, params=params,
                                 metadata={"summarize": plan.doc.path, "chunk": chunk.index})
            calls.append(TaskCall(job_id, model, TASK_MAP, (gjob.to_payload(),),
                                  f"summarize {plan.doc.path} chunk {chunk.index + 1}/{len(plan.chunks)}"))
    for plan in plans:
        spec_base = templates.reduce_spec(model, words, document_context(plan.title))
        for node in plan.reduces:
            spec = replace(spec_base, params=params, metadata={"summarize": plan.doc.path, "level": node.level},
                           level=node.level)
            calls.append(TaskCall(node.job_id, model, TASK_REDUCE, (spec.to_payload(), node.inputs),
                                  f"summarize {plan.doc.path} reduce level {node.level}", depends_on=list(node.inputs)))
    client.submit_calls(batch_id, calls, priority=priority, timeout=JOB_TIMEOUT, retries=JOB_RETRIES, extend=True)


def check_model(model: str, client: Client | None = None) -> None:
    """SummarizeError (model_not_found) unless the model is a known name or a .gguf file here, or (with a
    client: REDIS_URL) one its live workers hold: its jobs' queue is named after it."""
    why = (ModelCheck.live(client, files=True) if client is not None else ModelCheck(None, files=True))(model)
    if why is not None:
        raise SummarizeError(f"model_not_found: {why}")


def model_file_here(model: str) -> bool:
    """Whether the model's file is on this machine already (a .gguf path, or a known model in the cache)."""
    from engine.registry import ModelError, resolve

    try:
        return resolve(model, auto_pull=False).is_file()
    except ModelError:
        return False


def remote_plan(client: Client, model: str, kv_budget: str | None, err: IO[str],
                info: ModelInfo | None = None) -> tuple[int, PromptMeter]:
    """Producer-only: (the KV capacity to plan chunks for, the prompt meter). The capacity is the smallest
    the live workers of the model publish (a chunk must fit whichever takes it), lowered by --kv-budget;
    tokens are counted with the model file when it is here (info: the run's ModelInfo of it), else with
    the tokenizer and chat template the workers published (pipeline.model_header), so the weights need
    not be downloaded."""
    from engine.registry import cache_dir

    here = info is not None or model_file_here(model)
    live = live_kv_tokens(client.workers(), model)
    tokens = TOKENS_RE.fullmatch(kv_budget.strip()) if kv_budget else None
    if kv_budget is None and live is None:
        err.write(f"note: no live worker of {model} publishes its KV capacity yet: planning for the default "
                  f"budget {DEFAULT_KV_BUDGET} (--kv-budget sets another)\n")
    if kv_budget is None:
        capacity = live if live is not None else kv_capacity(info or model, DEFAULT_KV_BUDGET)
    else:
        own = int(tokens.group(1)) if tokens and not here else kv_capacity(info or model, kv_budget)
        capacity = min(own, live) if live is not None else own
    if here:
        return capacity, PromptMeter.for_model(info or model)
    header = cached_header(client.connection, model, cache_dir() / "headers")
    if header is not None:
        return capacity, PromptMeter.for_model(str(header))
    err.write(f"note: no live worker of {model} has published its tokenizer: fetching the model to count tokens\n")
    return capacity, PromptMeter.for_model(model)


def check_model_file(model: str | ModelInfo, kv_budget: str | None) -> None:
    """SummarizeError with the workers' own start-up refusal (an unknown architecture, a broken file, a bad
    budget) before anything is read or started: one line instead of a traceback or the workers' exits."""
    problem = model_file_problem(model, kv_budget)
    if problem is not None:
        raise SummarizeError(problem)


def open_model(model: str) -> ModelInfo:
    """The run's ModelInfo, once the model's file passed the workers' start-up check (check_model_file):
    opened once, then read by the planner, the memory guard and the choice of workers."""
    from pipeline.memory_guard import MemoryGuardError, open_model_info

    try:
        info = open_model_info(model)
    except MemoryGuardError as e:
        raise SummarizeError(str(e)) from None
    try:
        check_model_file(info, None)
    except SummarizeError:
        info.close()
        raise
    return info


def summarize(paths: Sequence[str], *, output: IO[str], fmt: str = "jsonl", model: str = DEFAULT_MODEL,
              workers: int | None = None, threads: int | None = None, template: str | None = None,
              kv_budget: str | None = None, max_summary_tokens: int = DEFAULT_MAX_SUMMARY_TOKENS,
              overlap_tokens: int = DEFAULT_OVERLAP_TOKENS, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
              max_bytes: int = DEFAULT_MAX_BYTES, redis_url: str | None = None, progress_stream: IO[str] | None = None,
              meter: PromptMeter | None = None, repack: bool = True,
              speculative: str = DEFAULT_SPECULATIVE, style: str = DEFAULT_STYLE) -> RunReport:
    """Summarise every readable document under `paths`; see the module docstring. repack=False: the
    embedded workers run with --no-repack. speculative: how the jobs guess tokens ("off": plain).
    style: the summaries' form (templates.STYLES)."""
    err = progress_stream if progress_stream is not None else sys.stderr
    t0 = time.monotonic()
    url = redis_url if redis_url is not None else redis_url_from_env()
    remote = reachable(url) if url else None  # a Redis that is not there: one line now, before any work
    check_model(model, Client(connection=remote) if remote is not None else None)
    # remote workers check their own files; a file here is opened once for the whole run
    info = open_model(model) if remote is None or model_file_here(model) else None
    try:
        return _summarize(paths, output=output, fmt=fmt, model=model, workers=workers, threads=threads,
                          template=template, kv_budget=kv_budget, max_summary_tokens=max_summary_tokens,
                          overlap_tokens=overlap_tokens, chunk_tokens=chunk_tokens, max_bytes=max_bytes,
                          meter=meter, repack=repack, speculative=speculative, style=style, err=err, t0=t0,
                          remote=remote, info=info)
    finally:
        if info is not None:
            info.close()


def _summarize(paths: Sequence[str], *, output: IO[str], fmt: str, model: str, workers: int | None,
               threads: int | None, template: str | None, kv_budget: str | None, max_summary_tokens: int,
               overlap_tokens: int, chunk_tokens: int, max_bytes: int, meter: PromptMeter | None, repack: bool,
               speculative: str, style: str, err: IO[str], t0: float, remote: Any,
               info: ModelInfo | None) -> RunReport:
    templates = Templates.load(template, style=style)
    settings = {"model": model, "style": style, "template": templates.source,
                "max summary tokens": max_summary_tokens, "chunk tokens": chunk_tokens,
                "overlap tokens": overlap_tokens, "speculative": speculative}
    docs, skipped = collect_documents(paths, max_bytes=max_bytes)
    for s in skipped:
        err.write(f"skipped {s.path}: {s.reason}\n")
    for d in docs:
        if d.encoding_note is not None:
            err.write(f"note: {d.path} is not UTF-8: {d.encoding_note}\n")
    if not docs:
        err.write("nothing to summarise\n")
        Output(output, fmt, model=model, settings=settings).finish(skipped, wall_seconds=time.monotonic() - t0)
        return RunReport(0, 0, 0, skipped, 0, 0, 0, time.monotonic() - t0, [])

    budget_text = kv_budget or DEFAULT_KV_BUDGET
    if remote is not None:
        capacity, remote_meter = remote_plan(Client(connection=remote), model, kv_budget, err, info)
        meter = meter or remote_meter
    else:
        capacity = kv_capacity(info, budget_text)
    budget = Budget(capacity=capacity, max_summary_tokens=max_summary_tokens, overlap_tokens=overlap_tokens,
                    chunk_tokens=chunk_tokens)
    if budget.prompt_limit < 32:
        raise SummarizeError(f"the KV budget holds {budget.capacity} tokens: too few for a prompt plus a "
                             f"{max_summary_tokens}-token summary; raise --kv-budget or lower --max-summary-tokens")
    meter = meter or PromptMeter.for_model(info or model)
    words = words_for(max_summary_tokens)
    fan_in = reduce_fan_in(meter, templates, budget, words)
    run_id = uuid.uuid4().hex[:12]
    err.write(f"summarising {len(docs)} document{'s' if len(docs) != 1 else ''} with {model}; KV budget "
              f"{budget.capacity} tokens, summaries up to {max_summary_tokens} tokens, up to {fan_in} per reduce\n")
    out = Output(output, fmt, model=model, settings=settings)

    def run(connection: Any, health: Callable[[], None] | None, remote: bool) -> list[DocState]:
        client = Client(connection=connection, result_ttl=RUN_RESULT_TTL, stream_ttl=RUN_STREAM_TTL)
        batch_id = client.open_batch(f"summarize_{run_id}", metadata={"summarize": len(docs)})
        # Plan and submit one document at a time: workers start on the first document's chunks
        # while later documents are still being tokenized.
        states: list[DocState] = []
        progress = Progress(len(docs), 0, stream=err)
        for i, d in enumerate(docs):
            plan = plan_document(i, d, run_id=run_id, model=model, meter=meter, templates=templates,
                                 budget=budget, fan_in=fan_in)
            submit_plans(client, batch_id, [plan], model=model, templates=templates, budget=budget,
                         speculative=speculative)
            states.append(DocState(plan, time.time()))
            progress.total_chunks += len(plan.chunks)
        progress.update(0, 0, force=True)

        def on_done(s: DocState) -> None:
            out.add(s.plan.index, s.record(model))
            if s.error:
                progress.message(f"failed {s.plan.doc.path}: {s.error}")

        def warn_if_no_workers() -> bool:
            """Say once that no worker serves the model yet; True: follow need not ask again."""
            if not remote:
                return True
            n = sum(1 for w in client.workers() if w["model"] and model_key(w["model"]) == model_key(model))
            if n == 0:
                progress.message(f"no worker for model {model} is connected to this Redis yet; waiting "
                                 f"(start one with: rqllm worker --model {model})")
            return True

        try:
            follow(client, batch_id, states, models=[model], reduce_labels=part_label_pattern(templates.part),
                   on_done=on_done, progress=progress, health=health, no_worker_warning=warn_if_no_workers)
        except KeyboardInterrupt:
            # Do not leave work behind in a shared Redis: cancel what has not ended.
            pending = [s for s in states if not s.done]
            for st in pending:
                cancel_rest(client, batch_id, st, why="the summarise run was interrupted")
            progress.message(f"interrupted: canceled the queued jobs of {len(pending)} unfinished "
                             f"document{'s' if len(pending) != 1 else ''}")
            raise
        finally:
            progress.close()
        return states

    if remote is not None:
        if workers is not None or threads:
            err.write("note: --workers and --threads only apply without REDIS_URL; the workers are the ones "
                      "already serving that Redis\n")
        states = run(remote, None, True)
    else:
        # map jobs, roughly (4 characters a token): enough to tell one worker's worth from several
        jobs = sum(max(1, len(d.text) // 4 // max(1, budget.prompt_limit) + 1) for d in docs)
        states = run_embedded(model, jobs, info=info, kv_budget=budget_text, workers=workers, threads=threads,
                              repack=repack, err=err, run=lambda conn, check: run(conn, check, False))
    wall = time.monotonic() - t0
    out.finish(skipped, wall_seconds=wall)
    records = [s.record(model) for s in states]
    report = RunReport(
        documents=len(states), summarised=sum(1 for s in states if not s.error),
        failed=sum(1 for s in states if s.error), skipped=skipped, chunks=sum(r["chunks"] for r in records),
        tokens_in=sum(r["tokens_in"] for r in records), tokens_out=sum(r["tokens_out"] for r in records),
        wall_seconds=wall, records=records,
    )
    err.write(f"done: {report.summarised} summarised, {report.failed} failed, {len(skipped)} skipped; "
              f"{report.tokens_in:,} tokens in, {report.tokens_out:,} out; {wall:.1f} s\n")
    return report


def run_embedded(model: str, jobs: int, *, info: Any, kv_budget: str, workers: int | None, threads: int | None,
                 repack: bool, err: IO[str], run: Callable[[Any, Callable[[], None]], Any]) -> Any:
    """run(connection, health check) against an embedded cluster sized for `jobs` jobs of `model` (the split
    of workers and threads chosen for this machine, each worker's share of the KV budget); its result."""
    worker_budget = worker_kv_budget(info, kv_budget)
    split = choose_embedded_split(model, jobs, workers=workers, threads=threads, kv_budget=worker_budget,
                                  repack=repack, info=info)
    with embedded_cluster(model, workers=split.workers, threads=split.threads, kv_budget=worker_budget,
                          repack=repack, split_reason=split.reason) as cluster:
        err.write(f"embedded: {cluster.split}\n")
        return run(connect(cluster.redis_url), cluster.check)
