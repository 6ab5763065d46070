"""Redis unreachable: one line naming the address and the reason, within seconds.

Commands (`submit`, `status`, `collect`, `watch`, `jobs`, `cancel`, `summarize`) run as real processes
against a TCP port where nothing listens and must fail at once with one line; before, they printed
nothing for ~31 s (the client's reconnect retries) and then a traceback. A worker waits instead: it
says "waiting for Redis at <address>" at once and takes jobs once a Redis starts on that port.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.redis_conn import RedisUnreachable, connect, probe, reachable, wait_for_redis
from pipeline.embedded_redis import free_port, redis_server_executable
from tests.process_waits import stop

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]
FEW_SECONDS = 6.0  # a process start (imports ~1 s on a busy machine) and one refused connect


def _env(url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    if url is not None:
        env["REDIS_URL"] = url
    return env


@pytest.mark.parametrize("args", [
    ["status"],
    ["collect", "batch_0123456789abcdef01234567", "--no-progress"],
    ["watch", "g0123"],
    ["submit", "--literal", "Hello"],
    ["jobs", "batch_0123456789abcdef01234567"],
    ["cancel", "batch_0123456789abcdef01234567"],
    ["summarize", "--model", "smollm2-135m", "{doc}"],
], ids=lambda a: a[0])
def test_a_command_says_in_one_line_at_once_that_redis_is_not_there(args, tmp_path):
    port = free_port()
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document about nothing in particular.\n")
    argv = [a.replace("{doc}", str(doc)) for a in args]
    t0 = time.monotonic()
    p = subprocess.run(CLI + argv, cwd=ROOT, env=_env(f"redis://127.0.0.1:{port}/0"), capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines() == [f"Error: cannot reach Redis at redis://127.0.0.1:{port}/0: "
                                             "connection refused"], p.stderr
    assert took < FEW_SECONDS, f"{argv[0]} took {took:.1f} s to say Redis is not there"


def test_the_message_never_shows_the_password():
    port = free_port()
    with pytest.raises(RedisUnreachable) as e:
        reachable(f"redis://:hunter2-secret@127.0.0.1:{port}/3")
    assert str(e.value) == f"cannot reach Redis at redis://127.0.0.1:{port}/3: connection refused"


def test_a_server_that_accepts_but_never_answers_times_out_in_seconds():
    """A socket connect timeout alone is not enough: a peer that takes the connection and never replies
    (a wedged server, a firewall that black-holes after the handshake) must time out too."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)  # read nothing, answer nothing

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(RedisUnreachable, match=rf"^cannot reach Redis at redis://127.0.0.1:{port}/0: .*timeout"):
            probe(connect(f"redis://127.0.0.1:{port}/0"), timeout=1.0)
        assert time.monotonic() - t0 < 3.0
    finally:
        listener.close()
        for c in held:
            c.close()


def test_wait_for_redis_says_where_at_once_and_backs_off():
    port = free_port()
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    ok = wait_for_redis(connect(f"redis://127.0.0.1:{port}/0"), log=lambda m: lines.append((time.monotonic() - t0, m)),
                        stop=lambda: time.monotonic() - t0 > 3.8)
    assert ok is False
    # tries at 0 s, 1 s and 3 s (sleeps of 1 s, then 2 s), the next one would be 4 s later
    assert [m for _, m in lines] == [
        f"waiting for Redis at redis://127.0.0.1:{port}/0 (connection refused); next try in {d} s" for d in (1, 2, 4)]
    assert lines[0][0] < 1.0 and 2.9 < lines[2][0] < 3.8


def _read_stderr_until(proc: subprocess.Popen, needle: str, timeout: float) -> tuple[str, float]:
    """Lines of proc's stderr up to the first one containing needle (and when it came)."""
    seen: list[str] = []
    found = threading.Event()
    at = [0.0]
    t0 = time.monotonic()

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if needle in line and not found.is_set():
                at[0] = time.monotonic() - t0
                found.set()

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"no {needle!r} within {timeout} s:\n{''.join(seen)}"
    return "".join(seen), at[0]


def test_a_worker_waits_for_redis_and_starts_when_it_comes(smollm2_path, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    worker = subprocess.Popen(CLI + ["worker", "--model", "smollm2-135m", "--threads", "1", "--name", "waiting-worker"],
                              cwd=ROOT, env=_env(url), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    server = None
    try:
        text, at = _read_stderr_until(worker, f"waiting for Redis at {url} (connection refused)", timeout=30)
        assert "Traceback" not in text
        assert worker.poll() is None  # it waits, it does not exit
        server = subprocess.Popen([redis_server_executable(), "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        conn = connect(url)
        deadline = time.monotonic() + 120
        while not conn.exists("rq:worker:waiting-worker"):
            assert time.monotonic() < deadline, "the worker did not register after Redis came"
            assert worker.poll() is None, "the worker exited"
            time.sleep(0.2)
    finally:
        stop(worker)
        if server is not None:
            server.terminate()
            server.wait(10)


def test_worker_help_says_it_waits_and_where_it_looks():
    p = subprocess.run(CLI + ["worker", "--help"], cwd=ROOT, env=_env(None), capture_output=True, text=True,
                       timeout=60)
    text = " ".join(p.stdout.split())
    assert 'prints "waiting for Redis at <address>"' in text
    assert "backoff" in text
    assert "else redis://127.0.0.1:6379/0" in text
