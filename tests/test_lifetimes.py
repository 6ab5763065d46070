"""Every process a command starts stops when the command ends, however it ends, and
`rqllm serve` starts a local worker again when it dies.

Real commands in subprocesses (`rqllm submit --wait` without REDIS_URL: an embedded redis-server and
worker; `rqllm serve` with its embedded Redis), real signals, SmolLM2-135M.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.api_server import ServeProcess
from tests.model_available import needs_model
from tests.process_waits import exited as _exited, wait_gone

M = "smollm2-135m"
ROOT = Path(__file__).resolve().parent.parent
KEY = "lifetime-key-0123456789"
COUNTING = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # the model keeps counting until max_tokens

pytestmark = needs_model(M)


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(str(p.pid))
    return "; ".join(out)


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def start_submit_wait(tmp_path: Path, n_prompts: int = 6) -> tuple[subprocess.Popen, Path]:
    """`rqllm submit --wait` on long prompts, embedded (no REDIS_URL)."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    err = tmp_path / "submit.err"
    # SIGUSR1 dumps every thread's stack into submit.err (a test that finds the command hung says where).
    # SIGINT as in a terminal's foreground command: a test run started in the background by a script
    # (`.ci/run &`) has SIGINT ignored, which its children inherit and Python keeps (POSIX: an async
    # list without job control). Then the command rightly ignored the test's "Ctrl-C" (twice in CI).
    code = "import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); " \
           "signal.signal(signal.SIGINT, signal.default_int_handler); from pipeline.cli import main; main()"
    cmd = [sys.executable, "-c", code, "submit", "--wait", "--no-progress",
           "--model", M, "--workers", "1", "--threads", "1", "--max-tokens", "400", "--literal",
           *[f"{COUNTING} ({i})" for i in range(n_prompts)]]
    with open(err, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f)
    return proc, err


def wait_running(proc: subprocess.Popen, err: Path, timeout: float = 180) -> list[psutil.Process]:
    """Until the embedded cluster runs a job: its redis-server and worker, both children of `proc`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, err.read_text()
        kids = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in kids if not _exited(p))
        if "redis-server" in names and "pipeline.cli_worker" in names and "embedded cluster" in err.read_text():
            worker = next(p for p in kids if "pipeline.cli_worker" in " ".join(p.cmdline()))
            # generating: the engine is loaded and busy (a few CPU seconds)
            if sum(worker.cpu_times()[:2]) > 3.0:
                return kids
        time.sleep(0.2)
    raise TimeoutError(f"the embedded cluster did not start: {err.read_text()[-2000:]}")


@pytest.mark.timeout(300)
def test_sigkill_of_submit_wait_leaves_no_child(tmp_path):
    proc, err = start_submit_wait(tmp_path)
    kids: list[psutil.Process] = []
    try:
        kids = wait_running(proc, err)
        assert any("redis-server" in " ".join(p.cmdline()) for p in kids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        left = wait_gone(kids, 5)
        assert left == [], f"still running after their command was SIGKILLed: {_describe(left)}"
    finally:
        proc.kill()
        _kill_all(kids)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_of_submit_wait_stops_its_children_at_once(tmp_path, sig):
    """As `timeout` does (SIGTERM), or Ctrl-C: the command stops its worker (not after finishing the queued
    prompts) and its Redis, then exits with the signal's code."""
    proc, err = start_submit_wait(tmp_path)
    kids: list[psutil.Process] = []
    try:
        kids = wait_running(proc, err)
        t0 = time.monotonic()
        proc.send_signal(sig)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            pytest.fail(f"still running 20 s after {sig.name}; its children: {_describe(kids)}; its stderr, "
                        f"ending with its threads' stacks:\n{err.read_text()[-6000:]}")
        assert time.monotonic() - t0 < 15
        assert code in (128 + sig, -sig, 1, 130), (code, err.read_text()[-2000:])
        left = wait_gone(kids, 5)
        assert left == [], f"still running after their command ended: {_describe(left)}"
        assert "Traceback" not in err.read_text()
    finally:
        proc.kill()
        _kill_all(kids)


# --------------------------------------------------------------------------- serve: a dead local worker
def _local_worker(server: ServeProcess) -> psutil.Process | None:
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "pipeline.cli_worker" in " ".join(p.cmdline()) and not _exited(p):
                return p
        except psutil.NoSuchProcess:
            pass
    return None


@pytest.mark.timeout(400)
def test_serve_restarts_a_dead_local_worker_and_the_request_on_it_fails_fast(tmp_path):
    """SIGKILL of the local worker mid-request: the streaming request on it ends with a `worker_lost` error
    within seconds (not a hang), a request sent meanwhile is served by the worker started in its place
    (not a 404), and so are later ones."""
    import openai

    server = ServeProcess(tmp_path / "data", redis_url=None, keys=[KEY], extra=["--threads", "1"])
    leftovers: list[psutil.Process] = []
    try:
        server.start().wait_ready(KEY, models=True, timeout=240)
        c = server.openai(KEY, timeout=120)
        first = _local_worker(server)
        assert first is not None
        leftovers.append(first)

        stream = c.chat.completions.create(model=M, messages=[{"role": "user", "content": COUNTING}],
                                           max_tokens=400, stream=True)
        got_text = False
        t_kill = None
        error: Exception | None = None
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and t_kill is None:
                    got_text = True
                    first.send_signal(signal.SIGKILL)  # mid-generation
                    t_kill = time.monotonic()
                    # a request sent while no worker runs: queued, then served by the replacement
                    meanwhile: dict = {}
                    sender = threading.Thread(target=lambda: meanwhile.update(r=_try(lambda: c.chat.completions.create(
                        model=M, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4))))
                    sender.start()
        except openai.APIError as e:
            error = e
        assert got_text and t_kill is not None
        assert error is not None, "the stream on the dead worker ended without an error"
        assert time.monotonic() - t_kill < 15, "the error came too late"
        assert "worker_lost" in str(error), error

        sender.join(180)
        r = meanwhile.get("r")
        assert not isinstance(r, Exception), f"the request sent while the worker was dead failed: {r!r}"
        assert r is not None and r.choices[0].message.content, r

        second = _local_worker(server)
        assert second is not None and second.pid != first.pid
        leftovers.append(second)
        assert "stopped (killed by SIGKILL); starting another" in server.log()
        again = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
        assert again.choices[0].message.content
        assert [m.id for m in c.models.list().data] == [M]

        kids = psutil.Process(server.proc.pid).children(recursive=True)
        assert server.stop() == 0  # and at shutdown the restarted worker stops like the first would have
        assert wait_gone(kids, 15) == []
    finally:
        server.kill()
        _kill_all(leftovers)


def _try(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the test reports it
        return e


def test_a_worker_keeps_dying_backs_off(monkeypatch):
    """The supervisor's arithmetic, without processes: the delay doubles while a worker dies young, up to
    the cap, and starts over after one that ran a while."""
    from pipeline.api import serve

    class Dead:
        class proc:
            returncode = -9

        def alive(self):
            return False

        def tail(self, n=10):
            return ""

        def close(self):
            pass

    spawned: list[str] = []
    slot = serve.WorkerSlot("m", "serve-1-m-0", Dead())
    sup = serve.WorkerSupervisor("unix:///nonexistent", [slot], lambda model, name: spawned.append(name) or Dead())
    sup._connection = object()
    monkeypatch.setattr(serve, "end_lost_job", lambda connection, name, how: None)  # no Redis here
    delays = []
    now = 1000.0
    for _ in range(9):
        sup._check(slot, now)  # dead: schedule
        delays.append(slot.restart_at - now)
        now = slot.restart_at
        sup._check(slot, now)  # restart
        now += 1  # and it dies young again
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert spawned[:3] == ["serve-1-m-0.1", "serve-1-m-0.2", "serve-1-m-0.3"]
    slot.started = now - serve.HEALTHY_AFTER  # this one ran a minute
    sup._check(slot, now)
    assert slot.restart_at - now == 1
