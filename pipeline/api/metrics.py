"""GET /metrics on `rqllm serve`: the queue as Redis holds it, in Prometheus's text format.

Read from Redis at each scrape, so they hold for the whole cluster (every worker anywhere, every producer):
jobs waiting and running per model and priority, and workers per model and state (busy, idle). What only a
worker knows (jobs by outcome, tokens, tok/s, speculative acceptance, KV use) each worker serves itself
(`rqllm worker --metrics-port`, pipeline.worker_metrics). Like every endpoint here it asks for an API key
(Prometheus: `authorization: {credentials: KEY}`).
"""
from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jobs import keys
from jobs.defaults import PRIORITIES
from jobs.schemas import model_key
from pipeline.api.auth import require_owner
from pipeline.api.state import api_state
from pipeline.client import Client

router = APIRouter()


def _model_and_priority(queue_name: str) -> tuple[str, str] | None:
    """(model key, priority) of one of our rq queues (rqllm:<model>:<priority>), else None."""
    if not queue_name.startswith(keys.QUEUE_NAME_PREFIX):
        return None
    model, _, priority = queue_name[len(keys.QUEUE_NAME_PREFIX):].rpartition(":")
    return (model, priority) if model and priority in PRIORITIES else None


class QueueCollector(Collector):
    def __init__(self, client: Client):
        self.client = client

    def collect(self) -> Iterator[Metric]:
        workers = self.client.workers()
        models = {model_key(w["model"]) for w in workers if w.get("model")}
        queues = {}
        for q in self.client.queues():
            mp = _model_and_priority(q.name)
            if mp is not None:
                queues[mp] = q
                models.add(mp[0])
        with self.client.connection.pipeline(transaction=False) as p:
            pairs = [(m, pr) for m in sorted(models) for pr in PRIORITIES]
            for m, pr in pairs:
                q = queues.get((m, pr)) or self.client.queue(m, pr)
                p.llen(q.key)
                p.zcard(q.started_job_registry.key)
            counts = p.execute()
        waiting = GaugeMetricFamily("rqllm_queue_jobs", "Jobs waiting in a model's queue, by priority",
                                    labels=["model", "priority"])
        running = GaugeMetricFamily("rqllm_queue_running_jobs", "Jobs of a model's queue that a worker runs now",
                                    labels=["model", "priority"])
        for i, (m, pr) in enumerate(pairs):
            waiting.add_metric([m, pr], counts[2 * i])
            running.add_metric([m, pr], counts[2 * i + 1])
        by_state: dict[tuple[str, str], int] = {(m, s): 0 for m in models for s in ("busy", "idle")}
        for w in workers:
            if w.get("model"):
                key = (model_key(w["model"]), str(w.get("state") or "unknown"))
                by_state[key] = by_state.get(key, 0) + 1
        state = GaugeMetricFamily("rqllm_workers", "Live workers, by model and state (busy: running a job)",
                                  labels=["model", "state"])
        for (m, s), n in sorted(by_state.items()):
            state.add_metric([m, s], n)
        yield from (waiting, running, state)


def metrics_registry(client: Client) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(client))
    return registry


@router.get("/metrics")
def metrics(request: Request, owner: str = Depends(require_owner)) -> Response:
    """Plain `def`: FastAPI runs it in its thread pool (blocking Redis calls)."""
    state = api_state(request)
    return Response(generate_latest(state.metrics), media_type=CONTENT_TYPE_LATEST)
