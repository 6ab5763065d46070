"""A summarise run's jobs go in as one batch through the Client, like any other: visible in the batch
list with every map and reduce job counted, reduces deferred on their inputs, the doorbell rung, and a
failed document's remaining jobs cancelled into the same ledger, so the batch ends. Real Redis, no
engine (planning with a test tokenizer)."""
from __future__ import annotations

from rq.job import Job

from jobs import keys
from jobs.outcomes import record_failure
from jobs.schemas import model_key
from pipeline.summarize import Budget, Document, Templates, plan_document, reduce_fan_in, submit_plans, words_for
from pipeline.summarize.follow import DocState, cancel_rest
from tests.conftest_redis import client, redis_conn, redis_server, redis_url  # noqa: F401
from tests.test_chunking import LONG_DOC
from tests.test_summarize_units import fake_meter

M = "smollm2-135m"


def _plan():
    meter, templates = fake_meter(), Templates.load()
    budget = Budget(capacity=400, max_summary_tokens=60, overlap_tokens=16)
    fan_in = reduce_fan_in(meter, templates, budget, words_for(budget.max_summary_tokens))
    plan = plan_document(0, Document("long.md", LONG_DOC, len(LONG_DOC)), run_id="t1", model=M, meter=meter,
                         templates=templates, budget=budget, fan_in=fan_in)
    return plan, templates, budget


def test_a_summarise_run_is_a_batch_that_ends_in_the_ledger(client):
    plan, templates, budget = _plan()
    batch_id = client.open_batch("summarize_t1", metadata={"summarize": 1})
    submit_plans(client, batch_id, [plan], model=M, templates=templates, budget=budget)

    listed = {b.batch_id: b for b in client.list_batches()}
    status = listed[batch_id]
    assert status.total == len(plan.job_ids) and status.models == [model_key(M)]
    assert [jid for _, jid in client.batch_entries(batch_id)] == plan.job_ids
    conn = client.connection
    assert conn.llen(keys.doorbell_key(model_key(M))) > 0
    for node in plan.reduces:
        job = Job.fetch(node.job_id, connection=conn, serializer=client.queue(M).serializer)
        assert job.get_status() == "deferred"
        assert set(job.dependency_ids) == set(node.inputs)
        assert job.failure_callback is not None  # abandoned or refused, it still reaches the ledger

    # The first map job fails: the follower cancels the document's other jobs into the ledger.
    first = plan.map_ids[0]
    record_failure(client.ledger, first, "worker_error", "boom", options=client.options)
    state = DocState(plan, 0.0, error=f"job {first} failed")
    cancel_rest(client, batch_id, state, why="another job of long.md failed")
    status = client.batch_status(batch_id)
    assert status.failed == status.total and status.finished
    results = dict(client.results(batch_id))
    assert results[plan.final_id].error.code == "canceled"
    assert Job.fetch(plan.final_id, connection=conn, serializer=client.queue(M).serializer).get_status() == "canceled"


def test_a_reduce_reads_its_inputs_from_the_ledger(redis_conn):
    """The reduce task takes its inputs' summaries from their JobResults in the ledger (as the producer's
    records do): tidied, empty ones left out, and part labels a lower reduce copied stripped."""
    from dataclasses import replace

    import pytest

    from jobs.schemas import JobResult
    from jobs.summarize_tasks import input_summaries
    from jobs.summary_unit import ReduceSpec

    spec = replace(Templates.load().reduce_spec(M, 40), params={"max_tokens": 60}, metadata={"summarize": "a.md"})
    assert ReduceSpec.from_payload(spec.to_payload()) == spec  # what goes through rq comes back the same
    ids = ["ledger-in-0", "ledger-in-1", "ledger-in-2"]
    for jid, text in zip(ids, ["Summary: Alpha ships in May.", "Part 2: Beta follows.", "  "]):
        redis_conn.set(keys.result_key(jid), JobResult(job_id=jid, status="done", text=text,
                                                       finish_reason="stop").model_dump_json())
    assert input_summaries(redis_conn, spec, ids) == ["Alpha ships in May.", "Part 2: Beta follows."]
    assert input_summaries(redis_conn, replace(spec, level=2), ids) == ["Alpha ships in May.", "Beta follows."]
    with pytest.raises(RuntimeError, match="ledger-in-missing has no summary"):
        input_summaries(redis_conn, spec, [ids[0], "ledger-in-missing"])
    redis_conn.set(keys.result_key("ledger-in-failed"), JobResult.failed("ledger-in-failed", "x", "y").model_dump_json())
    with pytest.raises(RuntimeError, match="ledger-in-failed has no summary"):
        input_summaries(redis_conn, spec, ["ledger-in-failed"])
    with pytest.raises(RuntimeError, match="all 1 input summaries are empty"):
        input_summaries(redis_conn, spec, ids[2:])
