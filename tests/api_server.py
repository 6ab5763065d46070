"""A real `rqllm serve` process for tests (the production command, in a subprocess), and its clients.

    server = ServeProcess(tmp_path / "data", redis_url=url, keys=["k1"]).start()
    server.wait_ready("k1")
    client = server.openai("k1")      # the official openai client, base_url pointing at the server
    server.kill()                     # SIGKILL; server.stop() is SIGTERM (graceful)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pipeline.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, data_dir: Path, *, redis_url: str | None, keys: list[str] | None = None,
                 extra: list[str] | None = None, port: int | None = None, log_path: Path | None = None):
        self.data_dir = Path(data_dir)
        self.redis_url = redis_url
        self.keys = list(keys or [])
        self.extra = list(extra or [])
        self.port = port or free_port()
        self.log_path = log_path or self.data_dir.parent / f"serve-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ServeProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RQLLM_API_KEYS")}
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), "--log-level", "warning"]
        if "--model" not in self.extra and "-m" not in self.extra:
            cmd += ["--model", "smollm2-135m"]  # the small model, whatever DEFAULT_MODEL is
        for k in self.keys:
            cmd += ["--api-key", k]
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it
        log.write(f"\n==== start {self.starts}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd + self.extra, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_ready(self, key: str | None = None, timeout: float = 180.0, models: bool = False) -> None:
        """Until GET /v1/models answers 200 (and, with `models`, lists at least one model)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"rqllm serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.base_url + "/models", headers=headers, timeout=5)
                if r.status_code == 200 and (not models or r.json()["data"]):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"rqllm serve not ready after {timeout} s:\n{self.log()}")

    def openai(self, key: str = "unused", **kwargs: Any):
        from openai import OpenAI

        kwargs.setdefault("max_retries", 0)  # a retried request would hide a failure
        kwargs.setdefault("timeout", 300.0)
        return OpenAI(base_url=self.base_url, api_key=key, **kwargs)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 90.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode
