"""Prometheus metrics, worker logs and readiness, on a real Redis, a real `rqllm serve` and a real
SmolLM2-135M worker (`python -m pipeline.cli_worker --metrics-port ... --ready-file ...`).

A batch runs while both /metrics are scraped: serve's queue depth goes down and its worker shows busy,
the worker's counters go up, and at the end they hold what the recorded results say. The worker logs one
INFO line per job and none of rq's routine lines; it is ready (file, /ready, gauge) only once its model is
loaded, and not after it exits.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from pipeline.client import Client
from pipeline.embedded import WorkerProcess, free_port, stop_workers, worker_argv
from tests.api_server import ServeProcess
from tests.conftest_redis import wait_for_workers
from tests.model_available import needs_model
from tests.redis_server import redis_server  # noqa: F401  (session fixture)

prometheus = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

M = "smollm2-135m"
KEY = "metrics-key-" + "m" * 16
N = 8  # jobs that succeed
pytestmark = needs_model(M)


class Samples(dict):
    """One scrape: (sample name, sorted labels) -> value."""

    def get_value(self, name: str, **labels: str) -> float | None:
        return self.get((name, tuple(sorted(labels.items()))))


def scrape(url: str, key: str | None = None) -> Samples:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    out = Samples()
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def stack(redis_server: str, tmp_path: Path) -> Iterator[tuple[ServeProcess, WorkerProcess, int, Path]]:  # noqa: F811
    Redis.from_url(redis_server).flushdb()
    port = free_port()
    ready = tmp_path / "run" / "worker.ready"
    ready.parent.mkdir()
    ready.write_text("stale\n")  # left by an earlier run that was killed: must not count
    cmd = worker_argv(redis_server, M, threads=1, name="metrics-w",
                      extra=["--metrics-port", str(port), "--ready-file", str(ready), "--maintenance-interval", "1",
                             "--prompt-lookup"])  # counting continues the prompt: guesses are checked and kept
    worker = WorkerProcess(cmd, str(tmp_path / "worker.log"))
    server = ServeProcess(tmp_path / "data", redis_url=redis_server, keys=[KEY]).start()
    try:
        yield server, worker, port, ready
    finally:
        server.stop()
        stop_workers([worker])


def test_metrics_move_during_a_batch(stack, redis_server: str, tmp_path: Path):  # noqa: F811
    server, worker, port, ready = stack
    worker_url = f"http://127.0.0.1:{port}"

    # Readiness: the stale file goes at once; the file, /ready and the gauge say ready only after the load.
    answers = []
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline and worker.alive(), worker.tail()
        try:
            r = httpx.get(worker_url + "/ready", timeout=5)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        try:
            content = ready.read_text()
        except FileNotFoundError:
            content = None
        answers.append((r.status_code, content, "loaded in" in Path(worker.log_path).read_text()))
        if r.status_code == 200:
            break
        time.sleep(0.02)
    # Before ready: 503, and never the stale file. The file is read after each answer, and the worker
    # writes it just before its gauge says ready, so a 503's file may already be the new one.
    pid = f"{worker.pid}\n"
    assert all(code == 503 and content in (None, pid) for code, content, _ in answers[:-1]), answers
    assert answers[-1][1:] == (pid, True)  # ready: the file is the worker's and the model was loaded before
    wait_for_workers(Redis.from_url(redis_server), ["metrics-w"])
    first = scrape(worker_url + "/metrics")
    assert first.get_value("rqllm_worker_ready", model=M) == 1
    assert first.get_value("rqllm_worker_jobs_total", model=M, outcome="done") == 0
    assert first.get_value("rqllm_kv_capacity_tokens", model=M) > 0

    server.wait_ready(KEY)
    assert httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=10).status_code == 401  # needs a key
    client = Client(redis_server)
    jobs = [{"model": M, "prompt": f"Count from {i} to 1000: {i}, {i + 1},", "custom_id": f"j{i}",
             "params": {"max_tokens": 24}} for i in range(N)]
    jobs.append({"model": M, "prompt": "Hi", "custom_id": "too-long", "params": {"max_tokens": 1_000_000}})
    batch = client.submit_batch(jobs)

    serve_scrapes, worker_scrapes = [], []
    deadline = time.monotonic() + 300
    while True:
        serve_scrapes.append(scrape(server.base_url.removesuffix("/v1") + "/metrics", KEY))
        worker_scrapes.append(scrape(worker_url + "/metrics"))
        if client.batch_status(batch).ended == N + 1:
            break
        assert time.monotonic() < deadline and worker.alive(), worker.tail()
        time.sleep(0.1)
    serve_scrapes.append(scrape(server.base_url.removesuffix("/v1") + "/metrics", KEY))
    worker_scrapes.append(scrape(worker_url + "/metrics"))

    # serve: the queue drains, the worker shows busy while it works
    depth = [s.get_value("rqllm_queue_jobs", model=M, priority="default") for s in serve_scrapes]
    assert depth[0] >= N - 2 and depth[-1] == 0 and len(set(depth)) >= 3, depth
    assert all(a >= b for a, b in zip(depth, depth[1:])), depth
    busy = [s.get_value("rqllm_workers", model=M, state="busy") for s in serve_scrapes]
    assert 1 in busy and serve_scrapes[-1].get_value("rqllm_workers", model=M, state="idle") == 1
    running = [s.get_value("rqllm_queue_running_jobs", model=M, priority="default") for s in serve_scrapes]
    assert set(running) == {0, 1}, running  # one worker: one job at a time
    assert serve_scrapes[-1].get_value("rqllm_queue_jobs", model=M, priority="high") == 0

    # the worker: counters move during the batch, and end at what the results say
    done = [s.get_value("rqllm_worker_jobs_total", model=M, outcome="done") for s in worker_scrapes]
    assert all(a <= b for a, b in zip(done, done[1:])) and len(set(done)) >= 3, done
    assert 1 in [s.get_value("rqllm_worker_busy", model=M) for s in worker_scrapes]
    last = worker_scrapes[-1]
    results = [r for _, r in client.results(batch)]
    ok = [r for r in results if r is not None and r.status == "done"]
    assert len(ok) == N
    assert last.get_value("rqllm_worker_jobs_total", model=M, outcome="done") == N
    assert last.get_value("rqllm_worker_jobs_total", model=M, outcome="invalid_request") == 1
    assert last.get_value("rqllm_prompt_tokens_total", model=M) == sum(r.prompt_tokens for r in ok)
    assert last.get_value("rqllm_generated_tokens_total", model=M) == sum(r.completion_tokens for r in ok)
    assert last.get_value("rqllm_prefix_cache_hit_tokens_total", model=M) == sum(r.prefix_hit_tokens for r in ok)
    assert last.get_value("rqllm_decode_tokens_per_second_count", model=M) == N
    assert last.get_value("rqllm_prefill_tokens_per_second_count", model=M) == N
    assert last.get_value("rqllm_decode_tokens_per_second_sum", model=M) > 0
    assert last.get_value("rqllm_job_generation_seconds_sum", model=M) == pytest.approx(
        sum(r.prefill_seconds + r.decode_seconds for r in ok), rel=1e-6)
    draft, kept = sum(r.draft_tokens for r in ok), sum(r.accepted_tokens for r in ok)
    assert kept > 0
    assert last.get_value("rqllm_speculative_draft_tokens_total", model=M) == draft
    assert last.get_value("rqllm_speculative_accepted_tokens_total", model=M) == kept
    assert last.get_value("rqllm_worker_busy", model=M) == 0
    assert 0 < last.get_value("rqllm_kv_used_tokens", model=M) <= last.get_value("rqllm_kv_capacity_tokens", model=M)

    # logs: one INFO line per job done, with tokens and speeds; none of rq's routine lines
    time.sleep(1.5)  # a maintenance pass (--maintenance-interval 1) while idle
    log = Path(worker.log_path).read_text()
    lines = [ln for ln in log.splitlines() if " done on metrics-w: " in ln]
    assert len(lines) == N, log[-3000:]
    assert all("tokens in" in ln and " out;" in ln and "tok/s" in ln for ln in lines)
    assert any("guesses kept" in ln for ln in lines)
    for routine in ("Successfully completed", "Job OK", "result is kept", "cleaning", ":default: g"):
        assert routine not in log, routine

    stop_workers([worker])
    assert not ready.exists()  # an exited worker is not ready


def test_rq_maintenance_line_is_debug(redis_server: str):  # noqa: F811
    """rq's "cleaning group registries" line, each maintenance interval, comes at DEBUG (and so not at all
    at INFO): rq's own call, caught on rq's logger."""
    import logging

    from rq.group import Group

    from jobs.schemas import queue_names
    from pipeline.worker import LLMWorker
    from pipeline.worker_logging import setup_worker_logging

    rq_log = logging.getLogger("rq.worker")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.NOTSET)
    handler.emit = records.append
    connection = Redis.from_url(redis_server)
    worker = LLMWorker(queue_names(M), model=M, name="maintenance-w", connection=connection)
    level = rq_log.level
    rq_log.addHandler(handler)
    try:
        for log_level in ("INFO", "DEBUG"):
            setup_worker_logging(log_level)
            connection.delete(Group.REDIS_GROUP_CLEANING_KEY)  # the pass runs (it holds a lock otherwise)
            records.clear()
            worker.clean_group_registries()
            cleaning = [r for r in records if "cleaning" in r.getMessage()]
            assert [r.levelno for r in cleaning] == ([] if log_level == "INFO" else [logging.DEBUG])
    finally:
        rq_log.removeHandler(handler)
        rq_log.setLevel(level)
