"""bench/fault_injection.py does what it prints: with small settings, every planned
fault happens - three SIGKILLs each of a worker running a job, a Redis restart while jobs are queued and
running, a collector kill while the batch still runs - and the run reports how many of each happened.

Real: redis-server with AOF, `python -m pipeline.cli_worker` processes running SmolLM2-135M, `rqllm
collect` as a subprocess (what the bench script runs; here on 120 jobs and 2 workers).
"""
from __future__ import annotations

import re
from pathlib import Path

from bench.fault_injection import COLLECTOR_KILL, PLAN, REDIS_RESTART, WORKER_KILL, Run, parse_args
from tests.model_available import needs_model

M = "smollm2-135m"


@needs_model(M)
def test_every_planned_fault_happens_and_is_counted(tmp_path: Path):
    args = parse_args(["--jobs", "120", "--workers", "2", "--seed", "11", "--fault-wait", "180", "--timeout", "900"])
    run = Run(args, tmp_path)
    try:
        ok = run.run()
    finally:
        run.close()
    report = "\n".join(run.report)
    assert dict(run.planned) == {WORKER_KILL: 3, REDIS_RESTART: 1, COLLECTOR_KILL: 1} == dict(
        (f, PLAN.count(f)) for f in PLAN)
    assert dict(run.happened) == dict(run.planned), report
    assert "faults: worker kill 3/3, redis restart 1/1, collector kill 1/1" in run.report, report
    assert not any("NOT" in x for x in run.report), report
    # each kill hit a job mid-run: the job ran again (attempt 2+) and its stream holds only that run
    assert len(run.killed_jobs) == 3 and "killed jobs' streams hold only their last run: True" in report, report
    shutdown = re.search(r"redis restart: shut down with (\d+) job\(s\) queued and (\d+) running", report)
    assert shutdown and int(shutdown[1]) > 0 and int(shutdown[2]) > 0, report
    assert ok, report
