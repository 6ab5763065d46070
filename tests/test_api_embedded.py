"""`rqllm serve` with no REDIS_URL: one command starts its own Redis (data in --data-dir) and a worker.

A stopped server leaves no process behind; a restarted one finds its files and stored results again
(the embedded Redis keeps an append-only file); a SIGKILLed one takes its children down with it.
"""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.api_server import ServeProcess
from tests.model_available import needs_model
from tests.process_waits import wait_gone

openai = pytest.importorskip("openai", reason="the openai client is in the test extras: pip install -e '.[test]'")

M = "smollm2-135m"
KEY = "embedded-key-0123456789"


pytestmark = needs_model(M)


def children(server: ServeProcess) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def test_embedded_server_one_command_restart_and_kill(tmp_path: Path):
    server = ServeProcess(tmp_path / "data", redis_url=None, keys=[KEY], extra=["--threads", "1"])
    leftovers: list[psutil.Process] = []
    try:
        server.start().wait_ready(KEY, models=True, timeout=240)
        kids = children(server)
        names = " ".join(" ".join(p.cmdline()) for p in kids)
        assert "redis-server" in names and "pipeline.cli_worker" in names
        c = server.openai(KEY)
        assert [m.id for m in c.models.list().data] == [M]
        request = dict(model=M, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6)
        first = c.chat.completions.create(**request)
        assert first.choices[0].message.content and first.usage.completion_tokens >= 1
        src = c.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")

        assert server.stop() == 0  # SIGTERM: workers and Redis stopped in order
        assert wait_gone(kids, 10) == []
        assert (tmp_path / "data" / "redis" / "appendonly.aof").exists() or \
            (tmp_path / "data" / "redis" / "appendonlydir").exists()

        server.start().wait_ready(KEY, models=True, timeout=240)
        c = server.openai(KEY)
        assert c.files.content(src.id).content == b'{"custom_id": "a"}\n'
        again = c.chat.completions.create(**request)  # the stored result, kept by Redis across the restart
        assert again.model_extra["rqllm"] == first.model_extra["rqllm"]
        assert again.choices[0].message.content == first.choices[0].message.content

        kids = children(server)
        redis = [p for p in kids if "redis-server" in " ".join(p.cmdline())]  # read before they may exit
        server.kill()  # SIGKILL: no shutdown code runs; the kernel stops the children (parent-death signal:
        # SIGTERM for redis-server, which closes its append-only file; SIGKILL for the worker, whose Redis is gone)
        assert wait_gone(redis, 15) == []
        workers = [p for p in kids if p not in redis]
        leftovers = workers
        assert workers and wait_gone(workers, 15) == [], "the worker outlived its server"
    finally:
        server.kill()
        for p in leftovers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
