"""The embedded Redis, and how the Redis URL reaches child processes (kept out of what `ps` shows).

The private redis-server of `rqllm submit --wait`, `summarize` and `serve` without REDIS_URL listens on a
unix socket in a 0700 directory (no TCP port), asks for a random password and refuses CONFIG and the
other commands rqllm never sends. Children get the URL through their environment, never argv; a worker
given a password on its command line moves it out of there.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, ResponseError

from pipeline.embedded import DISABLED_COMMANDS, RedisServer
from tests.model_available import needs_model
from tests.process_waits import stop

M = "smollm2-135m"
ROOT = Path(__file__).resolve().parent.parent


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


@pytest.fixture
def server():
    s = RedisServer().start()
    try:
        yield s
    finally:
        s.stop()


def test_embedded_redis_listens_on_a_private_socket_only(server):
    assert server.url.startswith("unix://:") and server.url.endswith(f"@{server.socket_path}?db=0")
    directory = Path(server.socket_path).parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert directory.stat().st_uid == os.getuid()
    assert stat.S_ISSOCK(Path(server.socket_path).stat().st_mode)
    # no TCP (or UDP) socket at all
    assert psutil.Process(server.proc.pid).net_connections(kind="inet") == []
    # its settings (the password among them) are in a file only its owner reads, not on its command line
    conf = directory / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert server.password in conf.read_text()
    assert server.password not in _cmdline(server.proc.pid)


def test_embedded_redis_requires_its_password(server):
    # an unauthenticated client (any local user who could reach the socket) is refused
    with pytest.raises((AuthenticationError, ResponseError), match="(?i)auth"):
        Redis(unix_socket_path=server.socket_path, socket_timeout=5).ping()
    with pytest.raises((AuthenticationError, ResponseError), match="(?i)(auth|password)"):
        Redis(unix_socket_path=server.socket_path, password="wrong", socket_timeout=5).ping()
    with pytest.raises((AuthenticationError, ResponseError), match="(?i)auth"):
        Redis(unix_socket_path=server.socket_path, socket_timeout=5).set("k", "v")
    assert len(server.password) >= 32
    with RedisServer() as other:
        assert other.password != server.password and other.socket_path != server.socket_path


def test_embedded_redis_refuses_config_and_other_dangerous_commands(server):
    from jobs.redis_conn import connect

    conn = connect(server.url)  # what every rqllm process uses
    assert conn.ping() and conn.set("k", "v") and conn.get("k") == b"v"
    for command in (["CONFIG", "SET", "dir", "/tmp"], ["CONFIG", "GET", "*"], ["DEBUG", "SLEEP", "0"],
                    ["MODULE", "LIST"], ["SAVE"], ["BGSAVE"], ["SHUTDOWN", "NOSAVE"], ["REPLICAOF", "NO", "ONE"],
                    ["MONITOR"], ["ACL", "LIST"]):
        with pytest.raises(ResponseError, match="unknown command"):
            conn.execute_command(*command)
    assert {"CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "SHUTDOWN"} <= set(DISABLED_COMMANDS)
    # what rqllm does use still works: scripts, streams, blocking pops, INFO (the reaper), FLUSHDB (tests)
    assert conn.eval("return 1", 0) == 1
    conn.xadd("s", {"a": "1"})
    assert conn.blpop(["nothing"], timeout=0.1) is None
    assert "uptime_in_seconds" in conn.info("server")
    assert conn.flushdb()
    conn.close()


def test_embedded_redis_stop_leaves_nothing(tmp_path):
    s = RedisServer().start()
    directory, pid = Path(s.socket_path).parent, s.proc.pid
    s.stop()
    assert not directory.exists()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_persistent_embedded_redis_keeps_its_data_privately(tmp_path):
    """`rqllm serve`'s: data in the data directory (made 0700), a new socket and password each start."""
    data = tmp_path / "redis"
    first = RedisServer(data_dir=data).start()
    try:
        first.client().set("kept", "yes")
        pw = first.password
    finally:
        first.stop()
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    second = RedisServer(data_dir=data).start()
    try:
        assert second.client().get("kept") == b"yes"
        assert second.password != pw
        with pytest.raises((AuthenticationError, ResponseError)):
            Redis(unix_socket_path=second.socket_path, password=pw, socket_timeout=5).ping()
    finally:
        second.stop()


def test_worker_command_carries_no_url():
    from pipeline.embedded import subprocess_env, worker_argv

    cmd = worker_argv("unix://:secret@/tmp/x/redis.sock?db=0", M, threads=1, name="w")
    assert "secret" not in " ".join(cmd) and "--redis-url" not in cmd
    assert cmd.redis_url == "unix://:secret@/tmp/x/redis.sock?db=0"
    assert subprocess_env(cmd.redis_url)["REDIS_URL"] == cmd.redis_url
    assert "REDIS_URL" not in subprocess_env()


# --------------------------------------------------------------------------- real processes
@needs_model(M)
@pytest.mark.timeout(300)
def test_no_child_of_submit_wait_has_the_password_on_its_command_line(tmp_path):
    """`rqllm submit --wait` without REDIS_URL: its redis-server and worker, while they run. The worker has
    the URL (with the password) in its environment, and nothing has it in argv."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    err = tmp_path / "err"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", "from pipeline.cli import main; main()", "submit", "--wait",
                                 "--no-progress", "--model", M, "--workers", "1", "--threads", "1",
                                 "--max-tokens", "300", "--literal", "Count from 1 to 1000: 1, 2, 3,"],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + 120
        worker = redis = None
        while time.monotonic() < deadline and (worker is None or redis is None):
            assert proc.poll() is None, err.read_text()
            for p in psutil.Process(proc.pid).children(recursive=True):
                line = _cmdline(p.pid)
                if "pipeline.cli_worker" in line:
                    worker = p
                elif "redis-server" in line:
                    redis = p
            time.sleep(0.1)
        assert worker is not None and redis is not None, err.read_text()
        url = worker.environ().get("REDIS_URL", "")
        assert url.startswith("unix://:"), f"the worker did not get the Redis URL through its environment: {url!r}"
        password = url.split("://:", 1)[1].split("@", 1)[0]
        assert len(password) >= 32
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            line = _cmdline(p.pid)
            assert password not in line and "--redis-url" not in line, line
        assert password not in err.read_text()  # nor in what the command prints
    finally:
        stop(proc)


@needs_model(M)
@pytest.mark.timeout(300)
def test_a_worker_given_a_password_in_argv_moves_it_out_of_ps(tmp_path):
    """`rqllm worker --redis-url URL-with-password`: the same process (pid) goes on without it in argv."""
    from pipeline.client import Client
    from tests.conftest_redis import wait_for_workers

    with RedisServer() as server:
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        env["PYTHONPATH"] = str(ROOT)
        log = open(tmp_path / "w.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli_worker", "--redis-url", server.url,
                                 "--model", M, "--threads", "1", "--name", "argv-w1"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = Client(server.url)
            wait_for_workers(client.connection, ["argv-w1"])
            assert psutil.Process(proc.pid).is_running()  # the same pid: execve, not a new process
            line = _cmdline(proc.pid)
            assert server.password not in line and "--redis-url" not in line, line
            assert "pipeline.cli_worker" in line and "--name argv-w1" in line
            jid = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 2}})
            deadline = time.monotonic() + 60
            while client.result(jid) is None:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert client.result(jid).status == "done"
        finally:
            stop(proc)
            log.close()
        assert server.password not in (tmp_path / "w.log").read_text(errors="replace")
