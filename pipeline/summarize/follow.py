"""Following a run's documents: each map and reduce job's outcome arrives through the batch's events
(pipeline.batch_events, as for the collector) and becomes that document's progress; a document is
done when its last job (the final reduce, or its only map) is, or failed when any of its jobs failed -
its other jobs are then cancelled (a reduce waiting for a failed input would wait forever)."""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.schemas import JobResult
from jobs.summary_unit import ChunkSummary, DocumentRecord
from pipeline.batch_events import BatchFollower
from pipeline.cancel import cancel_unwanted_job
from pipeline.client import Client
from pipeline.summarize.plan import DocPlan
from pipeline.summarize.report import Progress


@dataclass
class DocState:
    plan: DocPlan
    submitted_at: float
    results: dict[str, ChunkSummary] = field(default_factory=dict)  # by job id, the jobs that ended well
    error: str | None = None
    ended_at: float | None = None

    @property
    def maps_done(self) -> int:
        return sum(1 for j in self.plan.map_ids if j in self.results)

    @property
    def done(self) -> bool:
        return self.error is not None or self.plan.final_id in self.results

    def document_record(self, model: str) -> DocumentRecord:
        plan = self.plan
        return DocumentRecord.build(
            path=plan.doc.path, title=plan.title, sections=plan.sections, chunks=len(plan.chunks),
            reduce_levels=plan.levels, jobs=len(plan.job_ids), results=list(self.results.values()),
            final=self.results.get(plan.final_id), error=self.error,
            seconds=(self.ended_at or time.time()) - self.submitted_at, model=model, size=plan.doc.size,
            encoding=plan.doc.encoding, encoding_note=plan.doc.encoding_note)

    def record(self, model: str) -> dict[str, Any]:
        """The document's output line (DocumentRecord.to_dict)."""
        return self.document_record(model).to_dict()


def follow(client: Client, batch_id: str, states: Sequence[DocState], *, models: Sequence[str],
           reduce_labels: re.Pattern[str] | None, on_done: Callable[[DocState], None],
           progress: Progress | None = None, health: Callable[[], None] | None = None,
           no_worker_warning: Callable[[], bool] | None = None) -> None:
    """Until every document has a summary or an error. reduce_labels: the part labels a reduce job
    strips from its reply (jobs.summary_unit.part_label_pattern), to rebuild its record."""
    by_job = {j: s for s in states for j in s.plan.job_ids}
    inputs = {n.job_id: len(n.inputs) for s in states for n in s.plan.reduces}
    warned = False

    def show() -> None:
        if progress is not None:
            progress.update(sum(1 for s in states if s.done), sum(s.maps_done for s in states),
                            sum(1 for s in states if s.error))

    def on_end(job_id: str, result: JobResult | None) -> None:
        s = by_job[job_id]
        if s.done:
            return
        if result is not None and result.status == "done":
            s.results[job_id] = ChunkSummary.from_result(result, inputs=inputs.get(job_id, 1),
                                                         labels=reduce_labels if job_id in inputs else None)
        elif result is None:
            s.error = f"job {job_id} ended but its outcome is gone (expired?)"
        else:
            s.error = f"job {job_id} failed" + (f": {result.error.code}: {result.error.message}" if result.error else "")
        if s.done:
            s.ended_at = time.time()
            for j in s.plan.job_ids:
                follower.pending.pop(j, None)
            if s.error is not None:
                cancel_rest(client, batch_id, s, why=f"another job of {s.plan.doc.path} failed")
            on_done(s)
        show()

    def tick() -> None:
        if health is not None:
            health()
        show()

    def idle() -> None:
        nonlocal warned
        if not warned and no_worker_warning is not None:
            warned = no_worker_warning()

    follower = BatchFollower(client, batch_id, block_ms=500, health=tick, on_idle=idle, name="summarize")
    follower.follow([j for s in states if not s.done for j in s.plan.job_ids], on_end, models=models)
    show()


def cancel_rest(client: Client, batch_id: str, state: DocState, *, why: str) -> None:
    """Cancel a document's jobs that have not ended (recorded failed in the ledger, so the batch ends)."""
    for j in state.plan.job_ids:
        if j not in state.results:
            try:
                cancel_unwanted_job(client.connection, j, code="canceled", message=why, batch_id=batch_id,
                                    result_ttl=client.options.result_ttl, stream_ttl=client.options.stream_ttl)
            except Exception:  # noqa: BLE001 - best effort: the batch is reconciled later
                pass
